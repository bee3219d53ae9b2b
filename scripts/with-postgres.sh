#!/usr/bin/env bash
# Runs a command with DATABASE_URL pointing at a Postgres that answers, in this order:
#   1. DATABASE_URL, when it is set;
#   2. a Postgres on 127.0.0.1:5432;
#   3. `docker compose up -d postgres` (published on 15432), when a Docker engine is running;
#   4. a throwaway cluster from the local Postgres binaries (installed with apt-get when
#      missing and run as root), started on a free port and stopped when the command ends.
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

if [ "$throwaway" != 1 ] && [ -n "${DATABASE_URL:-}" ]; then
    exec "$@"
fi

if [ "$throwaway" != 1 ] && answers 127.0.0.1 5432; then
    DATABASE_URL="$local_url" exec "$@"
fi

if [ "$throwaway" != 1 ] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo "with-postgres: starting the postgres service of docker-compose.yml" >&2
    docker compose up -d --wait postgres
    DATABASE_URL="postgres://postgres@127.0.0.1:15432/postgres" exec "$@"
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
port=55432
while answers 127.0.0.1 "$port"; do port=$((port + 1)); done
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
