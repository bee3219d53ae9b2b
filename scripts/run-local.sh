#!/usr/bin/env bash
# `make run`: migrate the database in DATABASE_URL, enqueue a few sample messages, and run
# the relayer with the stdout sink until Ctrl-C. Run it through scripts/with-postgres.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
relay=target/release/outbox-relay
"$relay" migrate
for i in 1 2 3; do
    "$relay" enqueue --topic orders.created --key "customer-$i" --payload "{\"order_id\": $i, \"total\": $((i * 10))}" >/dev/null
done
"$relay" enqueue --topic orders.paid --key customer-1 --payload '{"order_id": 1}' >/dev/null
echo "enqueued 4 sample messages; relaying to stdout (Ctrl-C stops)" >&2
exec "$relay" run --sink stdout "$@"
