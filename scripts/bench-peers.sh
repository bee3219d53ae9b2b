#!/usr/bin/env bash
# `make bench-peers`: the relayer against graphile-worker, pg-boss and pgmq on one
# throwaway Postgres with its default settings, then the relayer's own shapes (hot key,
# fleet size, sustained load) on the same cluster. Prints figures; judges nothing.
#
#   scripts/bench-peers.sh [--quick] [BENCH ARGS...]
#
# --quick stops after the peers table (about 5 minutes; the whole run takes about 25).
# BENCH ARGS go to the peers comparison (e.g. --messages 200000 --rounds 3 --workers 2).
# The peers are installed into PEERS_DIR (default: $TMPDIR/outbox-relay-peers):
# graphile-worker and pg-boss from npm at pinned versions, and pgmq's SQL-only install
# from the pgmq wheel on PyPI (pgmq is left out when that download fails).
set -euo pipefail
cd "$(dirname "$0")/.."

GRAPHILE_WORKER=0.18.0
PG_BOSS=12.38.0
PGMQ_WHEEL=1.1.4 # carries pgmq 1.13.0's pgmq.sql

quick=0
args=()
for a in "$@"; do
    case "$a" in
    --quick) quick=1 ;;
    *) args+=("$a") ;;
    esac
done

dir=${PEERS_DIR:-${TMPDIR:-/tmp}/outbox-relay-peers}
mkdir -p "$dir"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bench-peers: installing Node.js with apt-get" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    else
        echo "bench-peers: Node.js and npm are needed for graphile-worker and pg-boss" >&2
        exit 1
    fi
fi
echo "bench-peers: installing graphile-worker@$GRAPHILE_WORKER and pg-boss@$PG_BOSS into $dir" >&2
(
    cd "$dir"
    [ -f package.json ] || echo '{"private": true}' >package.json
    npm install --no-audit --no-fund --loglevel=error \
        "graphile-worker@$GRAPHILE_WORKER" "pg-boss@$PG_BOSS" >/dev/null
)

if [ ! -s "$dir/pgmq.sql" ]; then
    wheels=$(mktemp -d)
    if python3 -m pip download --quiet --no-deps --dest "$wheels" "pgmq==$PGMQ_WHEEL" >/dev/null 2>&1; then
        python3 - "$wheels"/pgmq-*.whl "$dir/pgmq.sql" <<'EOF'
import sys, zipfile
with open(sys.argv[2], "wb") as out:
    out.write(zipfile.ZipFile(sys.argv[1]).read("pgmq/sql/pgmq.sql"))
EOF
    else
        echo "bench-peers: could not download the pgmq wheel; pgmq is left out" >&2
    fi
    rm -rf "$wheels"
fi

cargo build --release --quiet
bench=target/release/outbox-relay

# One throwaway cluster with Postgres's defaults (with-postgres.sh turns fsync off for
# tests; not here) serves every measurement below.
RUST_LOG=${RUST_LOG:-warn} THROWAWAY_POSTGRES=1 THROWAWAY_POSTGRES_SETTINGS="" \
    scripts/with-postgres.sh bash -c '
    set -euo pipefail
    bench=$1 dir=$2 quick=$3
    shift 3
    "$bench" bench --peers "$dir" "$@"
    [ "$quick" = 1 ] && exit 0
    echo
    "$bench" bench --hot-key 50000
    echo
    "$bench" bench --fleet 1,2,4,8,16 --messages 300000
    echo
    "$bench" bench --sustained-secs 600 --sustained-rate 10000
' bench-peers "$bench" "$dir" "$quick" "${args[@]}"
