#!/usr/bin/env bash
# The ring prototype under a held MVCC horizon: a producer offering RATE msg/s (pgbench,
# 20 messages a transaction), 2 relays (pgbench clients claiming up to 500 and completing
# them), a janitor rotating the ring every 5 s, and, after UNHELD seconds, a REPEATABLE
# READ session holding its snapshot for HOLD seconds (plus a transaction holding an id for
# the first third of it), then AFTER seconds more. Prints one line per WINDOW seconds:
# the delivery rate, the backlog, the claim's mean time (pg_stat_statements), the ring's
# size and its dead tuples; at the end, whether every message was delivered once.
# Needs DATABASE_URL, of the form postgres://…/DATABASE without parameters (a server with
# pg_stat_statements in shared_preload_libraries). The logs of pgbench and of the janitor
# are kept in a temporary directory, named at the start.
# usage: run.sh UNHELD HOLD AFTER [RATE] [GEN_SECS]
set -euo pipefail
cd "$(dirname "$0")"
unheld=$1 hold=$2 after=$3 rate=${4:-2000} gen=${5:-30} window=${WINDOW:-30}
total=$((unheld + hold + after))
db=ring_proto_$$
url="${DATABASE_URL%/*}/$db"
out=$(mktemp -d)
echo "logs: $out" >&2
psql -XAtq "$DATABASE_URL" -c "CREATE DATABASE $db"
cleanup() {
    kill $(jobs -p) 2>/dev/null || true
    wait 2>/dev/null || true
    psql -XAtq "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"
}
trap cleanup EXIT
PGOPTIONS='-c client_min_messages=warning' psql -XAtq -v ON_ERROR_STOP=1 "$url" -f schema.sql
psql -XAtq "$url" -c 'CREATE EXTENSION pg_stat_statements' -c 'SELECT pg_stat_statements_reset()' >/dev/null
psql -XAtq "$url" -c "SELECT ring.rotate($gen)" >/dev/null

pgbench -n -c 1 -R $((rate / 20)) -T "$total" -f produce.sql "$url" >"$out/producer.log" 2>&1 &
pgbench -n -c 2 -j 2 -T $((total + 10)) -f consume.sql "$url" >"$out/relays.log" 2>&1 &
(while sleep 5; do psql -XAtq "$url" -c "SELECT now()::time(0), ring.rotate($gen)"; done) >"$out/janitor.log" 2>&1 &
(sleep "$unheld"
 psql -XAtq "$url" -c 'BEGIN ISOLATION LEVEL REPEATABLE READ' -c 'SELECT count(*) FROM pg_class' \
      -c "SELECT pg_sleep($hold)" -c 'COMMIT') >/dev/null 2>&1 &
(sleep "$unheld"
 psql -XAtq "$url" -c 'BEGIN' -c 'SELECT pg_current_xact_id()' \
      -c "SELECT pg_sleep($((hold / 3)))" -c 'COMMIT') >/dev/null 2>&1 &

sample() {
    psql -XAtq -F ' ' "$url" -c "
      SELECT (SELECT last_value FROM ring.seq),
             (SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables
               WHERE schemaname = 'ring' AND relname LIKE 'done_%'),
             (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query LIKE 'SELECT ring.claim(%'),
             (SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements WHERE query LIKE 'SELECT ring.claim(%'),
             (SELECT sum(pg_total_relation_size(c.oid)) / 1048576.0 FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'ring' AND c.relkind = 'r'),
             (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = 'ring')"
}
printf '%6s %-7s %9s %8s %9s %9s %9s\n' time phase 'msg/s' backlog 'claim ms' 'ring MB' dead
read -r p0 d0 c0 t0 _ _ < <(sample)
for ((at = window; at <= total; at += window)); do
    sleep "$window"
    read -r p d c t mb dead < <(sample)
    if ((at <= unheld)); then phase=unheld; elif ((at <= unheld + hold)); then phase=held; else phase=after; fi
    awk -v at="$at" -v ph="$phase" -v w="$window" -v p="$p" -v d="$d" -v d0="$d0" -v c="$c" -v c0="$c0" \
        -v t="$t" -v t0="$t0" -v mb="$mb" -v dead="$dead" 'BEGIN {
        printf "%6d %-7s %9.0f %8d %9.2f %9.1f %9d\n", at, ph, (d - d0) / w, p - d,
               (c > c0 ? (t - t0) / (c - c0) : 0), mb, dead }'
    d0=$d c0=$c t0=$t
done
sleep 15
psql -XAtq "$url" -c "
  SELECT 'produced ' || (SELECT last_value FROM ring.seq)
      || ', delivered ' || (SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables
                             WHERE schemaname = 'ring' AND relname LIKE 'done_%')
      || ', left in the ring ' || (SELECT count(*) FROM ring.ready r
                                    WHERE NOT EXISTS (SELECT 1 FROM ring.done d WHERE d.seq = r.seq))"
echo "partitions truncated: $(grep -o truncated "$out/janitor.log" | wc -l)"
echo "truncations skipped (lock_timeout): $(grep -o busy "$out/janitor.log" | wc -l)"
echo "rotations refused (ring full): $(grep -o 'ring full' "$out/janitor.log" | wc -l)"
tail -4 "$out/relays.log"
