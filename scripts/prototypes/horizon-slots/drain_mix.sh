#!/usr/bin/env bash
# The unheld drain of several schema versions in one run: the migrations of MIGRATIONS_DIR
# up to each version of VERSIONS (default "31 32": before the ring of slots, and the slots),
# each in a schema of its own (outbox_v31, outbox_v32, the names rewritten as
# src/store/naming.rs does) of one database, each filled with MESSAGES (10 % keyed over 100
# keys, 256-byte payloads), then drained by ONE pgbench run of 2 clients × TXNS
# transactions, each of which picks one of the versions at random and claims 500 and
# completes them (../complete_all.sql). Every release sees the same machine at the same
# moment, which separate rounds on this VM do not (they moved by up to a quarter). Prints pgbench's
# report: per release, the mean time per batch of the claim and of the completion. Each
# schema is drained by about 2 × TXNS × 500 / (number of versions) messages: leave MESSAGES a margin over that,
# and check the `left:` lines (a schema that ran dry makes its batches cheaper). TRACK=all
# adds each function's self time per batch (track_functions). ENQUEUE=1 measures the
# producers instead: each transaction enqueues one message (outbox.enqueue, jsonb, 10 %
# keyed over 100 keys) into one of the versions at random; pgbench then reports the mean
# time per enqueue of each.
# Needs a superuser's DATABASE_URL (postgres://…/DATABASE, no parameters), pgbench, python3.
# usage: drain_mix.sh MIGRATIONS_DIR [MESSAGES] [TXNS]
set -euo pipefail
dir=$1 messages=${2:-150000} txns=${3:-300} versions=${VERSIONS:-31 32}
base=${DATABASE_URL%/*}
here=$(cd "$(dirname "$0")" && pwd)
db=drain_mix_$$
for last in $versions; do
    compgen -G "$dir/V${last}__*.sql" >/dev/null || { echo "drain_mix: no V$last in $dir" >&2; exit 1; }
done
out=$(mktemp -d)
cleanup() { rm -rf "$out"; psql -XAtq "$base/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; }
trap cleanup EXIT
psql -XAtq "$base/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" -c "ALTER DATABASE $db SET track_functions = '${TRACK:-none}'" >/dev/null
# V5's schema_version() reads refinery_schema_history; the migrations are applied by psql
# here, so an empty one stands in for refinery's.
psql -XAtq "$base/$db" -c "CREATE TABLE public.refinery_schema_history(version int4 primary key, name varchar(255), applied_on varchar(255), checksum varchar(255))"
for last in $versions; do
  s=outbox_v$last
  for f in $(printf '%s\n' "$dir"/V*__*.sql | sort -V); do
    v=$(basename "$f" | sed 's/^V\([0-9]*\)__.*/\1/')
    [ "$v" -le "$last" ] || continue
    python3 -c "
import re,sys
t=open(sys.argv[1]).read()
t=re.sub(r'(?<![A-Za-z0-9_])outbox\.', sys.argv[2]+'.', t)
t=re.sub(r'SCHEMA (IF NOT EXISTS )?outbox(?![A-Za-z0-9_])', lambda m: 'SCHEMA '+(m.group(1) or '')+sys.argv[2], t)
t=t.replace(\"'outbox_new'\", \"'\"+sys.argv[2]+\"_new'\")
print(t)" "$f" "$s" > "$out/m.sql"
    psql -XAtq -v ON_ERROR_STOP=1 "$base/$db" -1 -f "$out/m.sql" >/dev/null 2>"$out/err" || { echo "FAILED $s $f"; cat "$out/err"; exit 1; }
  done
  sed "s/outbox\./$s./g; s/public\.complete_all/public.complete_all_$last/g" "$here/../complete_all.sql" | psql -XAtq -v ON_ERROR_STOP=1 "$base/$db" >/dev/null
  cat >"$out/drain_$last.sql" <<SQL
SELECT count(*) AS n, coalesce(string_agg(outbox_id || ':' || lease_token, ','), '') AS leased
  FROM $s.claim_outbox_batch_seq(500, 'w' || :client_id, 60) \gset
SELECT public.complete_all_$last('w' || :client_id, ':leased');
SQL
  cat >"$out/enqueue_$last.sql" <<SQL
\\set k random(0, 999)
SELECT $s.enqueue('orders', '{"n": 1}'::jsonb, CASE WHEN :k < 100 THEN 'key-' || :k END);
SQL
  psql -XAtq "$base/$db" -c "
    INSERT INTO $s.messages (topic, message_key, payload)
    SELECT 'orders', CASE WHEN random() * 100 < 10 THEN 'key-' || (random() * 99)::int END,
           convert_to(rpad('{\"n\":' || g, 255, ' ') || '}', 'UTF8')
      FROM generate_series(1, $messages) g" >/dev/null
done
psql -XAtq "$base/$db" -c 'VACUUM ANALYZE' -c 'CHECKPOINT' -c 'SELECT pg_stat_reset()' >/dev/null
scripts=()
kind=drain
[ "${ENQUEUE:-0}" = 1 ] && kind=enqueue
for last in $versions; do scripts+=(-f "$out/${kind}_$last.sql@1"); done
pgbench -n -r -c 2 -j 2 -t "$txns" "${scripts[@]}" "$base/$db" 2>&1
sleep 1
[ "${TRACK:-none}" = none ] || psql -XAtq "$base/$db" -c "
  WITH b AS (SELECT schemaname, max(calls) FILTER (WHERE funcname = 'claim_outbox_batch_seq') OVER (PARTITION BY schemaname) AS batches, funcname, calls, self_time
               FROM pg_stat_user_functions WHERE schemaname LIKE 'outbox_v%')
  SELECT schemaname || ' ' || rpad(funcname, 32) || round((self_time / batches)::numeric, 3) || ' ms/batch (' || calls || ' calls)'
    FROM b WHERE self_time / batches > 0.02 ORDER BY schemaname, self_time DESC"
for last in $versions; do
  echo "outbox_v$last left: $(psql -XAtq "$base/$db" -c "SELECT count(*) FROM outbox_v$last.messages")"
done
