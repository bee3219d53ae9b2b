#!/usr/bin/env bash
# Drain throughput with nothing held: the ring prototype against the outbox's own SQL
# functions (claim_outbox_batch_seq + complete_outbox_batch), each driven the same way by
# 2 pgbench clients claiming up to BATCH and completing them in a second transaction,
# over a backlog of MESSAGES (KEYED_PERCENT, default 10, keyed over 100 keys), ROUNDS rounds interleaved. A
# client stops at its first empty claim. Prints msg/s per round.
# Needs DATABASE_URL (of the form postgres://…/DATABASE without parameters) and the relayer binary (OUTBOX_RELAY, default target/release/outbox-relay)
# to migrate the outbox schema.
# usage: drain.sh [MESSAGES] [BATCH] [ROUNDS] [KEYED_PERCENT]
set -euo pipefail
cd "$(dirname "$0")"
messages=${1:-300000} batch=${2:-500} rounds=${3:-3} keyed=${4:-10}
relay=${OUTBOX_RELAY:-../../../target/release/outbox-relay}
db=ring_drain_$$
url="${DATABASE_URL%/*}/$db"
out=$(mktemp -d)
psql -XAtq "$DATABASE_URL" -c "CREATE DATABASE $db"
trap 'rm -rf "$out"; psql -XAtq "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
PGOPTIONS='-c client_min_messages=warning' psql -XAtq -v ON_ERROR_STOP=1 "$url" -f schema.sql
DATABASE_URL="$url" "$relay" migrate >/dev/null
psql -XAtq -v ON_ERROR_STOP=1 "$url" -f ../complete_all.sql >/dev/null
cat >"$out/outbox.sql" <<SQL
SELECT count(*) AS n, coalesce(string_agg(outbox_id || ':' || lease_token, ','), '') AS leased
  FROM outbox.claim_outbox_batch_seq($batch, 'w' || :client_id, 60) \gset
\if :n = 0
SELECT 'drained' / 0;
\endif
SELECT public.complete_all('w' || :client_id, ':leased');
SQL
cat >"$out/ring.sql" <<SQL
SELECT l AS leased, (l <> '')::int AS n FROM ring.claim($batch, 'w' || :client_id, 60) AS l \gset
\if :n = 0
SELECT 'drained' / 0;
\endif
SELECT ring.complete(':leased');
SQL
fill() {
    psql -XAtq "$url" -c "TRUNCATE outbox.messages, outbox.attempts" -c "TRUNCATE ring.ready, ring.leases, ring.done" \
         -c "ALTER SEQUENCE ring.seq RESTART" -c "SELECT setval('ring.floor_' || s, 1, false) FROM generate_series(0, 15) s" \
         -c "SELECT setval(s::regclass, 0, false) FROM unnest(ARRAY['ring.bound', 'ring.mark_seq', 'ring.mark_xid', 'ring.mark_at']) AS s" >/dev/null
    psql -XAtq "$url" -c "
      INSERT INTO outbox.messages (topic, message_key, payload)
      SELECT 'orders', CASE WHEN random() * 100 < $keyed THEN 'key-' || (random() * 99)::int END,
             convert_to(rpad('{\"n\":' || g, 255, ' ') || '}', 'UTF8')
        FROM generate_series(1, $messages) g" -c "SELECT ring.enqueue($messages, $keyed)" >/dev/null
    psql -XAtq "$url" -c 'VACUUM ANALYZE' -c 'CHECKPOINT' >/dev/null
}
left() {
    case $1 in
        outbox) psql -XAtq "$url" -c 'SELECT count(*) FROM outbox.messages' ;;
        ring) psql -XAtq "$url" -c 'SELECT count(*) FROM ring.ready r WHERE NOT EXISTS (SELECT 1 FROM ring.done d WHERE d.seq = r.seq)' ;;
    esac
}
for ((r = 1; r <= rounds; r++)); do
    for c in outbox ring; do
        fill
        s=$(date +%s.%N)
        pgbench -n -c 2 -j 2 -t 100000 -f "$out/$c.sql" "$url" >"$out/$c.log" 2>&1 || true
        e=$(date +%s.%N)
        l=$(left "$c")
        awk -v c="$c" -v r="$r" -v s="$s" -v e="$e" -v m="$messages" -v l="$l" \
            'BEGIN { printf "round %d %-6s %8.0f msg/s (%d of %d left)\n", r, c, (m - l) / (e - s), l, m }'
    done
done
