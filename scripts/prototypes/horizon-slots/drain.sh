#!/usr/bin/env bash
# Drain throughput with nothing held, the slots of product.patch against the release they
# were measured on: one database migrated by each binary (BEFORE and AFTER, e.g. builds of
# the commit the patch names and of it with the patch applied), and a third migrated by
# AFTER in which every statement of the drain's functions that reads outbox.messages is
# pointed at slot 0's own table, outbox.messages_0, instead of at the partitioned table (a
# measurement, not a design: slot 0 holds the whole backlog here; the functions are
# rewritten from pg_get_functiondef with only that table name changed). Each database is
# filled with MESSAGES (10 % keyed over 100 keys, 256-byte payloads) and drained by 2
# pgbench clients claiming up to 500 and completing them in a second transaction, ROUNDS
# rounds interleaved. Prints msg/s per round and the mean time per call of the drain's
# functions (track_functions, self time, ms).
# Needs DATABASE_URL (of the form postgres://…/DATABASE without parameters) of a superuser
# (it creates the databases and sets track_functions), pgbench and bc; a throwaway cluster:
# scripts/with-postgres.sh with THROWAWAY_POSTGRES=1.
# usage: drain.sh BEFORE AFTER [MESSAGES] [ROUNDS]
set -euo pipefail
before=$1 after=$2 messages=${3:-300000} rounds=${4:-4}
base=${DATABASE_URL%/*}
dbs=(slots_before_$$ slots_after_$$ slots_direct_$$)
# the drain's functions: rewritten in the third database, timed in every one
funcs=(claim_outbox_batch_seq claim_shard_candidates complete_outbox_batch lock_keys promote_heads)
out=$(mktemp -d)
cleanup() {
    rm -rf "$out"
    for db in "${dbs[@]}"; do
        psql -XAtq "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
for db in "${dbs[@]}"; do
    psql -XAtq "$DATABASE_URL" -c "CREATE DATABASE $db" -c "ALTER DATABASE $db SET track_functions = 'all'"
done
DATABASE_URL="$base/${dbs[0]}" "$before" migrate >/dev/null
DATABASE_URL="$base/${dbs[1]}" "$after" migrate >/dev/null
DATABASE_URL="$base/${dbs[2]}" "$after" migrate >/dev/null
for f in "${funcs[@]}"; do
    psql -XAtq "$base/${dbs[2]}" -c "SELECT pg_get_functiondef('outbox.$f'::regproc) || ';'" |
        sed 's/outbox\.messages AS/outbox.messages_0 AS/g' |
        psql -XAtq -v ON_ERROR_STOP=1 "$base/${dbs[2]}" >/dev/null
done
for db in "${dbs[@]}"; do
    psql -XAtq -v ON_ERROR_STOP=1 "$base/$db" -f "$(dirname "$0")/../complete_all.sql" >/dev/null
done
cat >"$out/drain.sql" <<'SQL'
SELECT count(*) AS n, coalesce(string_agg(outbox_id || ':' || lease_token, ','), '') AS leased
  FROM outbox.claim_outbox_batch_seq(500, 'w' || :client_id, 60) \gset
\if :n = 0
SELECT 'drained' / 0;
\endif
SELECT public.complete_all('w' || :client_id, ':leased');
SQL
for r in $(seq 1 "$rounds"); do
    for db in "${dbs[@]}"; do
        url="$base/$db"
        psql -XAtq "$url" -c "TRUNCATE outbox.messages, outbox.attempts" >/dev/null
        psql -XAtq "$url" -c "
          INSERT INTO outbox.messages (topic, message_key, payload)
          SELECT 'orders', CASE WHEN random() * 100 < 10 THEN 'key-' || (random() * 99)::int END,
                 convert_to(rpad('{\"n\":' || g, 255, ' ') || '}', 'UTF8')
            FROM generate_series(1, $messages) g" >/dev/null
        psql -XAtq "$url" -c 'VACUUM ANALYZE' -c 'CHECKPOINT' -c 'SELECT pg_stat_reset()' >/dev/null
        start=$(date +%s.%N)
        pgbench -n -c 2 -j 2 -t 1000000 -f "$out/drain.sql" "$url" >/dev/null 2>&1 || true
        end=$(date +%s.%N)
        sleep 1
        echo "round $r ${db%_$$}: $(echo "$messages / ($end - $start)" | bc) msg/s," \
             "left $(psql -XAtq "$url" -c 'SELECT count(*) FROM outbox.messages')"
        psql -XAtq "$url" -c "
          SELECT '  ' || funcname || ' ' || round((self_time / calls)::numeric, 2) || ' ms'
            FROM pg_stat_user_functions
           WHERE funcname = ANY (string_to_array('${funcs[*]}', ' '))
           ORDER BY funcname"
    done
done
