#!/usr/bin/env bash
# `make run`: the relayer on a working default. Builds the demo binary (cargo profile
# `demo`: stdout, file and null only, unoptimized; with cargo's progress) unless
# OUTBOX_RELAY_BIN names a binary to use instead (a release download, or
# target/release/outbox-relay), creates the database `outbox_demo` (DEMO_DATABASE) on the server of
# DATABASE_URL when it is missing, migrates it, enqueues a few sample messages and relays
# them to stdout until Ctrl-C. No other database of the server is touched; migrating
# creates schema `outbox` in the demo database and, when they do not exist yet, the
# cluster-wide roles outbox_relay, outbox_producer and outbox_reader. `make clean-demo`
# removes them. Run it through scripts/with-postgres.sh, which provides DATABASE_URL.
set -euo pipefail
cd "$(dirname "$0")/.."

demo=${DEMO_DATABASE:-outbox_demo}
case "$demo" in
    *[!a-z0-9_]* | "") echo "run-local: DEMO_DATABASE must be a lower-case SQL name, got '$demo'" >&2; exit 2 ;;
esac
command -v psql >/dev/null 2>&1 || {
    echo "run-local: needs psql, the PostgreSQL client (apt-get install postgresql-client)" >&2
    exit 1
}
server_url=${DATABASE_URL:?DATABASE_URL is not set: run through scripts/with-postgres.sh}
# The same server and credentials, the demo database instead of the URL's own.
demo_url=$(printf '%s' "$server_url" | sed -E "s#^(postgres(ql)?://[^/?]*)(/[^?]*)?#\1/$demo#")

if [ -n "${OUTBOX_RELAY_BIN:-}" ]; then
    relay=$OUTBOX_RELAY_BIN
    [ -x "$relay" ] || { echo "run-local: OUTBOX_RELAY_BIN=$relay is not an executable file" >&2; exit 2; }
    echo "run-local: using $relay (OUTBOX_RELAY_BIN)" >&2
else
    relay=target/demo/outbox-relay
    # Say how long only when cargo has something to compile: a first build, or sources
    # newer than the binary.
    if [ ! -x "$relay" ] || [ -n "$(find src schema build.rs Cargo.toml Cargo.lock -newer "$relay" -print -quit)" ]; then
        echo "run-local: building the demo binary, stdout/file/null destinations only (about 1 minute the first time on a quiet 2-core machine; a release binary from the project's releases skips it: OUTBOX_RELAY_BIN=path/to/outbox-relay make run)" >&2
    fi
    cargo build --profile demo --no-default-features --bin outbox-relay
fi

exists=$(psql "$server_url" -XAtqc "SELECT 1 FROM pg_database WHERE datname = '$demo'")
if [ "$exists" != 1 ]; then
    psql "$server_url" -Xqc "CREATE DATABASE $demo"
    echo "run-local: created database $demo ('make clean-demo' removes it)" >&2
else
    echo "run-local: using database $demo ('make clean-demo' removes it)" >&2
fi
applied=$(DATABASE_URL="$demo_url" "$relay" migrate | grep -c '^applied' || true)
echo "run-local: schema outbox in $demo is current ($applied migrations applied now)" >&2

export DATABASE_URL="$demo_url"
for i in 1 2 3; do
    "$relay" enqueue --topic orders.created --key "customer-$i" --payload "{\"order_id\": $i, \"total\": $((i * 10))}" >/dev/null
done
"$relay" enqueue --topic orders.paid --key customer-1 --payload '{"order_id": 1}' >/dev/null
echo "run-local: enqueued 4 sample messages; relaying to stdout (Ctrl-C stops)" >&2
exec "$relay" run --sink stdout --all-topics "$@"
