#!/usr/bin/env bash
# `make chaos`: runs the fault-injection suite (tests/chaos) against a throwaway Postgres
# cluster of its own, which the pg-restart scenario restarts and stops, and never the
# machine's shared one. The binary and the suite are built first, with the tests' profile and
# target directory (one build serves both); the rolling-upgrade scenario also builds the
# previous release's binary from git, once per commit, under target/rolling-upgrade/ (see
# tests/chaos/rolling_upgrade.rs).
#   scripts/chaos.sh [--short] [--only NAME,NAME] [--messages N] [--outage-secs S] [--previous REF] ...
# The cluster runs with fsync=off: the scenarios kill Postgres processes, not the machine,
# and a process crash loses nothing the kernel already has.
set -euo pipefail
cd "$(dirname "$0")/.."

bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "chaos: installing PostgreSQL with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
fi
[ -n "$bindir" ] || { echo "chaos: no Postgres binaries under /usr/lib/postgresql" >&2; exit 1; }

cargo build --bin outbox-relay --test chaos

as_owner=()
[ "$(id -u)" = 0 ] && as_owner=(runuser -u postgres --)
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=56432
while answers "$port"; do port=$((port + 1)); done
dir=$(mktemp -d /tmp/outbox-chaos.XXXXXX)
[ "$(id -u)" = 0 ] && chown postgres "$dir"
pg_ctl="${as_owner[*]} $bindir/pg_ctl -D $dir/data -l $dir/postgres.log"
stop() {
    $pg_ctl -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap stop EXIT
echo "chaos: throwaway cluster on 127.0.0.1:$port ($dir)" >&2
"${as_owner[@]}" "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
cat >> "$dir/data/postgresql.conf" <<CONF
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
max_connections = 200
fsync = off
CONF
$pg_ctl -w start >/dev/null

DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres" CHAOS_PG_CTL="$pg_ctl" \
    cargo test --quiet --test chaos -- "$@"
