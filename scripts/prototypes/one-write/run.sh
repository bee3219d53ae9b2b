#!/usr/bin/env bash
# Issue 58's prototypes against today's claim and completion, measured interleaved in one
# database. Each variant lives in a schema of its own in one database (the released
# migrations V1..LAST, default 38, renamed as src/store/naming.rs does, plus the variant's
# SQL), is filled with MESSAGES messages (10 % keyed over 100 keys, 256-byte payloads), and
# ONE pgbench run of 2 clients drains them all: each transaction picks a variant at random
# and claims a batch and completes it, all delivered. Every variant sees the same machine
# at the same moment.
#
#   today  outbox_t:   the released claim_outbox_batch_seq + complete_outbox_batch
#   a      outbox_a:   proto_a.sql: the delivered attempts as one row of arrays per call
#   ag     outbox_ag:  a, with the GIN index on the ids a per-message read by id would need
#   ac     outbox_ac:  proto_ac.sql: a batch lease row written once by the claim and once by
#                      each completion, holding the attempts; messages deleted as today
#   abc    outbox_abc: ac + proto_abc.sql: unkeyed delivered messages left in their slot,
#                      fenced by the batch row, passed by the probe (one row write each)
#   l      outbox_l:   proto_l.sql: today's claim without its lock of each head (the
#                      lease's UPDATE locks); a Heap/LOCK record less per message
#   al     outbox_al:  a + l
#   o      outbox_o:   proto_o.sql: a claim of one statement per shard and slot (an UPDATE
#                      whose ctid list is the shard's heads FOR UPDATE SKIP LOCKED, then
#                      one for the runs behind its keyed heads): no turn, no probe
#   oa     outbox_oa:  o + a
#   o1     outbox_o1:  o + proto_o1.sql: the same with no shard walk, one statement over
#                      the slot from an index of heads (available_at, seq)
#   o1a    outbox_o1a: o1 + a
#   floor  outbox_f:   the bare floor: one DELETE … RETURNING of a batch by id order plus
#                      its attempts' INSERT, one statement, no lease (bench --peers's)
#   pgmq   pgmq_like:  pgmq_like.sql: pgmq's read (visibility-time UPDATE) + delete by id
#
# Per run it prints, per variant: batches, messages delivered, the mean time per batch
# (pgbench) and the messages per second it is worth at 2 clients (2 × batch / time), the
# database time per message and the WAL bytes per message (pg_stat_statements, whose
# statement timing and WAL include the functions' nested statements; commit records are
# not in it), the split between claim and completion, and the load average.
#
# usage: run.sh [MESSAGES] (env: BATCHES="500 100", ROUNDS=2, VARIANTS, LAST=38,
#        MIGRATIONS=schema/migrations, KEEP=1 keeps the last run's database)
# Needs a superuser's DATABASE_URL (postgres://…/DATABASE, no parameters) on a server with
# shared_preload_libraries = pg_stat_statements, pgbench and python3. Run it from the
# repository's root. For the figures in docs/performance-history.md: a throwaway cluster
# with Postgres's defaults (fsync on), nothing else of one's own running.
set -euo pipefail
messages=${1:-240000}
batches=${BATCHES:-500 100}
rounds=${ROUNDS:-2}
variants=${VARIANTS:-today a o oa o1 o1a floor pgmq}
last=${LAST:-38}
migrations=${MIGRATIONS:-schema/migrations}
base=${DATABASE_URL%/*}
here=$(cd "$(dirname "$0")" && pwd)
tpl=one_write_tpl_$$
db=one_write_run_$$
out=$(mktemp -d)
cleanup() {
  rm -rf "$out"
  psql -XAtq "$base/postgres" -c "DROP DATABASE IF EXISTS $tpl WITH (FORCE)" >/dev/null 2>&1 || true
  [ "${KEEP:-0}" = 1 ] || psql -XAtq "$base/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

schema_of() {
  case $1 in
    today) echo outbox_t ;; a) echo outbox_a ;; ag) echo outbox_ag ;; ac) echo outbox_ac ;;
    abc) echo outbox_abc ;; l) echo outbox_l ;; al) echo outbox_al ;;
    o) echo outbox_o ;; oa) echo outbox_oa ;; o1) echo outbox_o1 ;; o1a) echo outbox_o1a ;;
    floor) echo outbox_f ;; pgmq) echo pgmq_like ;;
    *) echo "run.sh: unknown variant $1 (today a ag ac abc l al o oa o1 o1a floor pgmq)" >&2; exit 2 ;;
  esac
}
rename() { # FILE SCHEMA: the file with the outbox schema renamed
  python3 -c "
import re,sys
t=open(sys.argv[1]).read()
t=re.sub(r'(?<![A-Za-z0-9_])outbox\.', sys.argv[2]+'.', t)
t=re.sub(r'SCHEMA (IF NOT EXISTS )?outbox(?![A-Za-z0-9_])', lambda m: 'SCHEMA '+(m.group(1) or '')+sys.argv[2], t)
t=t.replace(\"'outbox_new'\", \"'\"+sys.argv[2]+\"_new'\")
print(t)" "$1" "$2"
}

# The template: every variant's schema, empty.
psql -XAtq "$base/postgres" -c "CREATE DATABASE $tpl" >/dev/null
psql -XAtq -v ON_ERROR_STOP=1 "$base/$tpl" \
  -c "CREATE TABLE public.refinery_schema_history(version int4 primary key, name varchar(255), applied_on varchar(255), checksum varchar(255))" \
  -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
for v in $variants; do
  s=$(schema_of "$v")
  if [ "$v" = pgmq ]; then
    psql -XAtq -v ON_ERROR_STOP=1 "$base/$tpl" -f "$here/pgmq_like.sql" >/dev/null
    continue
  fi
  : >"$out/all.sql"
  for f in $(printf '%s\n' "$migrations"/V*__*.sql | sort -V); do
    n=$(basename "$f" | sed 's/^V\([0-9]*\)__.*/\1/')
    [ "$n" -le "$last" ] || continue
    { echo "BEGIN;"; rename "$f" "$s"; echo "COMMIT;"; } >>"$out/all.sql"
  done
  case $v in
    a) rename "$here/proto_a.sql" "$s" >>"$out/all.sql" ;;
    ag) rename "$here/proto_a.sql" "$s" | sed 's/^-- :GIN //' >>"$out/all.sql" ;;
    ac) rename "$here/proto_ac.sql" "$s" >>"$out/all.sql" ;;
    abc) { rename "$here/proto_ac.sql" "$s"; rename "$here/proto_abc.sql" "$s"; } >>"$out/all.sql" ;;
    l) rename "$here/proto_l.sql" "$s" >>"$out/all.sql" ;;
    al) { rename "$here/proto_a.sql" "$s"; rename "$here/proto_l.sql" "$s"; } >>"$out/all.sql" ;;
    o) rename "$here/proto_o.sql" "$s" >>"$out/all.sql" ;;
    oa) { rename "$here/proto_o.sql" "$s"; rename "$here/proto_a.sql" "$s"; } >>"$out/all.sql" ;;
    o1) { rename "$here/proto_o.sql" "$s"; rename "$here/proto_o1.sql" "$s"; } >>"$out/all.sql" ;;
    o1a) { rename "$here/proto_o.sql" "$s"; rename "$here/proto_o1.sql" "$s"; rename "$here/proto_a.sql" "$s"; } >>"$out/all.sql" ;;
  esac
  psql -XAtq -v ON_ERROR_STOP=1 "$base/$tpl" -f "$out/all.sql" >/dev/null 2>"$out/err" || { echo "FAILED loading $v"; cat "$out/err"; exit 1; }
  [ "$v" = floor ] || sed "s/outbox\./$s./g; s/public\.complete_all/public.complete_all_$v/g" "$here/../complete_all.sql" |
    psql -XAtq -v ON_ERROR_STOP=1 "$base/$tpl" >/dev/null
done

# The pgbench scripts, one per variant.
for v in $variants; do
  s=$(schema_of "$v")
  case $v in
    floor) cat >"$out/$v.sql" <<SQL
WITH done AS (
    DELETE FROM $s.messages
     WHERE outbox_id = ANY (ARRAY(SELECT outbox_id FROM $s.messages ORDER BY outbox_id LIMIT :batch FOR UPDATE SKIP LOCKED))
 RETURNING outbox_id, attempt_count)
INSERT INTO $s.attempts (outbox_id, attempt_no, state, worker_id, lease_token)
SELECT outbox_id, attempt_count + 1, 'DISPATCHED', 'w' || :client_id, gen_random_uuid() FROM done;
SQL
    ;;
    pgmq) cat >"$out/$v.sql" <<SQL
SELECT coalesce(array_agg(msg_id)::text, '{}') AS ids FROM $s.read(30, :batch) \gset
SELECT count(*) FROM $s.delete(':ids'::bigint[]);
SQL
    ;;
    *) cat >"$out/$v.sql" <<SQL
SELECT count(*) AS n, coalesce(string_agg(outbox_id || ':' || lease_token, ','), '') AS leased
  FROM $s.claim_outbox_batch_seq(:batch, 'w' || :client_id, 60) \gset
\\if :n > 0
SELECT public.complete_all_$v('w' || :client_id, ':leased');
\\endif
SQL
    ;;
  esac
done

nvar=$(echo $variants | wc -w)
for round in $(seq 1 "$rounds"); do
  for batch in $batches; do
    psql -XAtq "$base/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db TEMPLATE $tpl" >/dev/null
    for v in $variants; do
      s=$(schema_of "$v")
      if [ "$v" = pgmq ]; then
        psql -XAtq "$base/$db" -c "INSERT INTO $s.q (message) SELECT jsonb_build_object('n', g, 'pad', repeat('x', 236)) FROM generate_series(1, $messages) g" >/dev/null
      else
        psql -XAtq "$base/$db" -c "
          INSERT INTO $s.messages (topic, message_key, payload)
          SELECT 'orders', CASE WHEN random() * 100 < 10 THEN 'key-' || (random() * 99)::int END,
                 convert_to(rpad('{\"n\":' || g, 255, ' ') || '}', 'UTF8')
            FROM generate_series(1, $messages) g" >/dev/null
      fi
    done
    # 2 clients, enough batches for each variant to drain about 0.85 × MESSAGES
    txns=$(( (messages * 85 / 100) * nvar / batch / 2 ))
    psql -XAtq "$base/$db" -c 'VACUUM ANALYZE' -c 'CHECKPOINT' -c 'SELECT pg_stat_statements_reset()' -c 'SELECT pg_stat_reset()' >/dev/null
    lsn0=$(psql -XAtq "$base/$db" -c 'SELECT pg_current_wal_lsn()')
    load0=$(cut -d' ' -f1-3 /proc/loadavg)
    scripts=()
    for v in $variants; do scripts+=(-f "$out/$v.sql@1"); done
    pgbench -n -r -c 2 -j 2 -t "$txns" -D batch="$batch" "${scripts[@]}" "$base/$db" >"$out/pgbench" 2>&1 || { cat "$out/pgbench"; exit 1; }
    load1=$(cut -d' ' -f1-3 /proc/loadavg)
    lsn1=$(psql -XAtq "$base/$db" -c 'SELECT pg_current_wal_lsn()')
    echo "== round $round, batch $batch: $messages messages per variant, 2 clients × $txns transactions; load average $load0 before, $load1 after; WAL of the run $(psql -XAtq "$base/$db" -c "SELECT pg_size_pretty(pg_wal_lsn_diff('$lsn1', '$lsn0'))")"
    # WAL_DIR (the server's pg_wal, readable here): the run's WAL by record type, for a run
    # of one variant (VARIANTS=today …): which writes a delivered message leaves
    if [ -n "${WAL_DIR:-}" ]; then
      echo "WAL of the run by record type (pg_waldump --stats=record), per message delivered:"
      "${PG_WALDUMP:-pg_waldump}" -p "$WAL_DIR" -s "$lsn0" -e "$lsn1" --stats=record 2>/dev/null |
        python3 -c "
import re, sys
n = int(sys.argv[1])
num = r'\s+(\d+)\s+\(\s*[0-9.]+\)'
rows = []
for line in sys.stdin:
    m = re.match(r'^(\S+/\S+)' + num * 4, line)
    if m:
        name, count, rec, fpi, total = m.group(1), *map(int, m.groups()[1:])
        rows.append((total, name, count, rec, fpi))
for total, name, count, rec, fpi in sorted(rows, reverse=True)[:12]:
    print('  %-24s %9d records %7.2f per message  records %6.0f B/msg  full pages %6.0f B/msg' % (name, count, count / n, rec / n, fpi / n))
" "$((messages * 85 / 100))" || true
    fi
    # per variant: batches and mean ms per batch from pgbench; time and WAL from pg_stat_statements
    python3 - "$out/pgbench" $variants >"$out/pgb" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
names = sys.argv[2:]
parts = re.split(r'\nSQL script \d+: ', text)[1:] or [text]  # one script: no sections
for i, part in enumerate(parts):
    n = re.search(r'- (\d+) transactions|transactions actually processed: (\d+)', part)
    n = n.group(1) or n.group(2)
    lat = re.search(r'latency average = ([0-9.]+) ms', part).group(1)
    stmts = re.findall(r'^\s+([0-9.]+)\s+\d+\s+(\S.*)$', part, re.M)
    split = ' '.join(s[0] for s in stmts)
    print(names[i], n, lat, split)
PY
    printf '%-6s %8s %9s %10s %10s %12s %11s %s\n' variant batches delivered ms/batch msg/s µs/msg WAL-B/msg "ms per statement (claim/read, complete/delete)"
    while read -r v n lat split; do
      s=$(schema_of "$v")
      if [ "$v" = pgmq ]; then left="SELECT count(*) FROM $s.q"; else left="SELECT count(*) FROM $s.messages WHERE lease_token IS NULL"; fi
      left=$(psql -XAtq "$base/$db" -c "$left")
      delivered=$((messages - left))
      read -r us wal < <(psql -XAtq -F ' ' "$base/$db" -c "
        SELECT round((sum(total_exec_time) * 1000 / $delivered)::numeric, 2), round(sum(wal_bytes) / $delivered)
          FROM pg_stat_statements WHERE query LIKE '%$s.%' OR query LIKE '%complete_all_$v(%'")
      printf '%-6s %8s %9s %10s %10.0f %12s %11s %s\n' "$v" "$n" "$delivered" "$lat" \
        "$(python3 -c "print(2 * $delivered / $n / $lat * 1000)")" "$us" "$wal" "$split"
      [ "$left" -gt 0 ] || echo "  ($v ran dry: its last batches were cheaper; raise MESSAGES)"
    done <"$out/pgb"
    # what readers see: one attempt per delivered message, and a second completion of a
    # delivered message's lease reported lost (P7002 from complete_outbox_attempt)
    for v in $variants; do
      s=$(schema_of "$v")
      case $v in floor|pgmq) continue ;; today|l|o|o1) log=$s.attempts ;; *) log=$s.attempts_all ;; esac
      psql -XAtq "$base/$db" -c "
        SELECT '  check $v: ' || count(*) || ' attempts of ' || count(DISTINCT outbox_id) || ' messages, '
               || (SELECT count(*) FROM $s.messages m WHERE m.lease_token IS NULL) || ' messages unleased; '
               || coalesce((SELECT 'second completion: lease_lost = ' || c.lease_lost
                              FROM (SELECT * FROM $log ORDER BY created_at DESC LIMIT 1) AS a,
                                   $s.complete_outbox_batch(a.worker_id, ARRAY[a.outbox_id], ARRAY[a.lease_token],
                                                            ARRAY['DISPATCHED']::$s.attempt_state[], NULL, NULL) AS c), '')
          FROM $log"
      psql -XAtq "$base/$db" -c "
        DO \$\$ DECLARE a record; BEGIN
          SELECT * INTO a FROM $log ORDER BY created_at DESC LIMIT 1;
          PERFORM $s.complete_outbox_attempt(a.outbox_id, a.lease_token, a.worker_id, 'DISPATCHED');
          RAISE NOTICE '  check $v: the second complete_outbox_attempt was accepted';
        EXCEPTION WHEN SQLSTATE 'P7002' THEN RAISE NOTICE '  check $v: the second complete_outbox_attempt raised P7002';
        END \$\$" 2>&1 | sed 's/^NOTICE: *//'
    done
  done
done
