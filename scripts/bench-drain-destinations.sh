#!/usr/bin/env bash
# The drain end to end: `outbox-relay bench --destination D` for each destination and
# number of relays, interleaved round by round, so that every shape sees the same moment
# of a shared machine. Each run is one bench in a database of its own (created and
# dropped by the bench): MESSAGES pre-enqueued messages (10 % keyed over 100 keys,
# 256-byte JSON payloads) drained by WORKERS relays in one process (each relay its own
# worker id, pool and claim loop; 3 batches in flight each) into the destination:
#
#   null   nothing is sent: the relayer and Postgres alone; the same run also drains
#          MESSAGES with the bench's bare SQL floor first (one DELETE … RETURNING plus the
#          attempts' INSERT per batch, from as many clients as relays: `floor` below);
#   http   the bench's own HTTP receiver (axum on 127.0.0.1, answers 200 to every POST),
#          one request per message, as the HTTP destination sends them;
#   kafka  a Kafka-protocol broker on 127.0.0.1:9092 (tansu, as scripts/test-services.sh
#          starts it), one topic of 3 partitions, idempotent producer, acks=all.
#
# It prints the bench's drain line of each run, then a table of msg/s per shape and
# round and the load average before each run. It judges nothing.
#
# usage: scripts/bench-drain-destinations.sh [MESSAGES] (env: ROUNDS=2, WORKERS="1 2",
#        DESTINATIONS="null http kafka", BATCH=500, BIN=target/release/outbox-relay)
# Needs DATABASE_URL (a superuser's, on a throwaway cluster) and, for kafka, the broker.
set -euo pipefail
messages=${1:-200000}
rounds=${ROUNDS:-2}
workers=${WORKERS:-1 2}
destinations=${DESTINATIONS:-null http kafka}
batch=${BATCH:-500}
bin=${BIN:-target/release/outbox-relay}
out=$(mktemp)
trap 'rm -f "$out" "$out.run" "$out.err"' EXIT

for round in $(seq 1 "$rounds"); do
  for w in $workers; do
    for d in $destinations; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      "$bin" bench --destination "$d" --messages "$messages" --workers "$w" --batch-size "$batch" \
        --big-backlog 0 --rate 1000 --latency-secs 2 >"$out.run" 2>"$out.err" || true
      for shape in "floor: bare SQL" "relay drain into $d" "relay drain (null"; do
        line=$(grep -F "$shape" "$out.run" | head -1 || true)
        [ -n "$line" ] || continue
        rate=$(sed -n 's/.*= \([0-9]*\) msg\/s.*/\1/p' <<<"$line")
        name=$d; [ "$shape" = "floor: bare SQL" ] && name="floor"
        echo "round $round, $w relays, $name, load $load: $line"
        echo "$round $w $name $rate $load" >>"$out"
      done
      grep -q "relay drain" "$out.run" || { echo "round $round, $w relays, $d: FAILED"; tail -3 "$out.err"; }
    done
  done
done

echo
echo "msg/s ($messages messages, batch $batch; load average at each run's start in brackets)"
python3 - "$out" <<'PY'
import sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r, w, d, rate, load = line.split()
    runs[(int(w), d)].append((int(rate), load))
for (w, d), rs in sorted(runs.items()):
    cells = '  '.join(f'{rate:>7} [{load}]' for rate, load in rs)
    print(f'{w} relay{"s" if w > 1 else " "}  {d:<6} {cells}')
PY
