#!/usr/bin/env bash
# Runs a command with DATABASE_URL pointing at a Postgres that answers, in this order:
#   1. DATABASE_URL, when it is set;
#   2. a Postgres on 127.0.0.1:5432;
#   3. `docker compose up -d postgres` (published on 15432), when a Docker engine is running;
#      when the command ends, what this run started is stopped and what it created is removed
#      (a container that was already running is left running, one that existed stopped is
#      stopped again); the postgres image it may have pulled stays, as a download cache;
#   4. a throwaway cluster from the local Postgres binaries (installed with apt-get when
#      missing and run as root), started on a free port and stopped when the command ends.
# Both cleanups also run when the script is interrupted (SIGINT, SIGTERM), once the command
# has ended.
# With THROWAWAY_POSTGRES=1, always 4. The throwaway cluster runs with fsync off (tests
# need no durability); THROWAWAY_POSTGRES_SETTINGS replaces that (e.g. with nothing, for
# Postgres's defaults in a benchmark).
# Usage: scripts/with-postgres.sh COMMAND [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."

local_url="postgres://postgres@127.0.0.1:5432/postgres"

answers() { # host port
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h "$1" -p "$2" -t 3
    else
        (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
    fi
}

throwaway=${THROWAWAY_POSTGRES:-0}

# Bash runs the EXIT trap (the cleanups below) on these signals only when they are trapped.
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$throwaway" != 1 ] && [ -n "${DATABASE_URL:-}" ]; then
    exec "$@"
fi

if [ "$throwaway" != 1 ] && answers 127.0.0.1 5432; then
    DATABASE_URL="$local_url" exec "$@"
fi

if [ "$throwaway" != 1 ] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 \
    && docker compose version >/dev/null 2>&1; then
    # What exists before `up`, so that only what this run starts or creates is undone.
    was_running=$(docker compose ps --status running --quiet postgres)
    had_container=$(docker compose ps --all --quiet postgres)
    networks_before=$(docker network ls --format '{{.Name}}')
    undo_compose() {
        if [ -n "$was_running" ]; then
            return 0
        fi
        if [ -n "$had_container" ]; then
            echo "with-postgres: stopping the postgres service again" >&2
            docker compose stop postgres >/dev/null 2>&1 || true
            return 0
        fi
        local id project network
        id=$(docker compose ps --all --quiet postgres || true)
        if [ -z "$id" ]; then
            return 0
        fi
        project=$(docker inspect --format '{{index .Config.Labels "com.docker.compose.project"}}' "$id" || true)
        echo "with-postgres: removing the postgres container it started" >&2
        # With its anonymous data volume; named volumes are never touched.
        docker compose rm --stop --force --volumes postgres >/dev/null 2>&1 || true
        # The project's network, when `up` created it; removing it fails (harmlessly) while
        # another container of the project still uses it.
        for network in $(docker network ls --format '{{.Name}}' \
            --filter "label=com.docker.compose.project=$project" || true); do
            if ! grep -qxF -- "$network" <<<"$networks_before"; then
                docker network rm "$network" >/dev/null 2>&1 || true
            fi
        done
    }
    trap undo_compose EXIT
    if [ -n "$was_running" ]; then
        echo "with-postgres: waiting for the running postgres service of docker-compose.yml" >&2
    else
        echo "with-postgres: starting the postgres service of docker-compose.yml (stopped when the command ends)" >&2
    fi
    docker compose up -d --wait postgres
    DATABASE_URL="postgres://postgres@127.0.0.1:15432/postgres" "$@"
    exit 0
fi

bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "with-postgres: installing PostgreSQL with apt-get (no Postgres answers and none is installed: the throwaway cluster needs its binaries; about a minute)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
fi
if [ -z "$bindir" ]; then
    echo "with-postgres: no Postgres answers on 127.0.0.1:5432, no Docker engine, and no" \
         "local Postgres binaries; set DATABASE_URL or install PostgreSQL" >&2
    exit 1
fi

# initdb and postgres refuse to run as root.
as_owner=()
if [ "$(id -u)" = 0 ]; then
    as_owner=(runuser -u postgres --)
fi
# A port nobody listens on and no socket holds (a connection to an earlier throwaway
# cluster in TIME-WAIT keeps its port from being bound again for a minute).
port_taken() {
    answers 127.0.0.1 "$1" \
        || { command -v ss >/dev/null 2>&1 && [ -n "$(ss -Htan "sport = :$1")" ]; }
}
port=55432
while port_taken "$port"; do port=$((port + 1)); done
dir=$(mktemp -d /tmp/outbox-pg.XXXXXX)
[ "$(id -u)" = 0 ] && chown postgres "$dir"
stop() {
    "${as_owner[@]}" "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap stop EXIT
echo "with-postgres: starting a throwaway cluster on 127.0.0.1:$port ($dir)" >&2
"${as_owner[@]}" "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
"${as_owner[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200 ${THROWAWAY_POSTGRES_SETTINGS--c fsync=off}" start >/dev/null
DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres" "$@"
