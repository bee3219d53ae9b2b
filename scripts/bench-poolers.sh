#!/usr/bin/env bash
# The relayer through PgBouncer against the relayer direct (docs/poolers.md): the drain of a
# backlog by relayer processes (null destination) with the mean time of a claim and of a
# completion as the relayers saw them, then the pickup time at low load (enqueue to
# delivery, one message at a time) with a direct listen_url and with a deaf listener.
# Starts a PgBouncer of its own (transaction mode, pool of 20) in front of DATABASE_URL's
# server on a free port, in a database of its own that it drops at the end.
#   scripts/bench-poolers.sh [MESSAGES] [RELAYERS]      (defaults: 100000 2)
# Needs the release binary (make build) and pgbouncer (apt-get install pgbouncer).
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${1:-100000}
relayers=${2:-2}
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
bin=target/release/outbox-relay
[ -x "$bin" ] || { echo "bench-poolers: build the release binary first (make build)" >&2; exit 2; }
[ -x /usr/sbin/pgbouncer ] || { echo "bench-poolers: apt-get install pgbouncer" >&2; exit 2; }

db=outbox_bench_poolers_$$
dir=$(mktemp -d /tmp/bench-poolers.XXXXXX)
chmod 755 "$dir"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
host=$(python3 -c "import urllib.parse,sys; u=urllib.parse.urlparse(sys.argv[1]); print(u.hostname or '127.0.0.1', u.port or 5432)" "$server")
printf '"postgres" ""\n' >"$dir/users.txt"
cat >"$dir/pgbouncer.ini" <<EOF
[databases]
* = host=${host% *} port=${host#* }
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/users.txt
pool_mode = transaction
default_pool_size = 20
max_client_conn = 500
ignore_startup_parameters = extra_float_digits,options
EOF
chmod 644 "$dir"/*
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    psql "$server" -XAtqc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT
as_user=(); [ "$(id -u)" = 0 ] && as_user=(-u postgres)
/usr/sbin/pgbouncer "${as_user[@]}" "$dir/pgbouncer.ini" 2>"$dir/pgbouncer.log" &
pids+=($!)
psql "$server" -XAtqc "CREATE DATABASE $db"
direct=$(python3 -c "import sys,urllib.parse as p; u=p.urlparse(sys.argv[1]); print(u._replace(path='/$db').geturl())" "$server")
pooled="postgres://postgres@127.0.0.1:$port/$db"
DATABASE_URL=$direct "$bin" migrate >/dev/null
sql() { psql "$direct" -XAtqc "$1"; }

# Mean of a histogram on a relayer's /metrics, in ms.
mean_ms() {
    curl -s "http://$1/metrics" | awk -v m="$2" '
        $1 == m"_sum" { s = $2 } $1 == m"_count" { c = $2 }
        END { if (c > 0) printf "%.1f", s / c * 1000; else printf "-" }'
}

# drain LABEL URL STATEMENTS: fills the backlog, starts the relayers, times the drain.
drain() {
    local label=$1 url=$2 statements=$3 start end i addrs=() rp=()
    sql "INSERT INTO outbox.messages (topic, message_key, payload)
         SELECT 'bench', CASE WHEN i % 10 = 0 THEN 'k' || (i % 50) END,
                convert_to(json_build_object('n', i, 'pad', repeat('x', 230))::text, 'UTF8')
           FROM generate_series(1, $messages) AS i"
    sql "VACUUM ANALYZE outbox.messages" >/dev/null
    start=$(date +%s.%N)
    for i in $(seq 1 "$relayers"); do
        addrs+=("127.0.0.1:$((port + i))")
        DATABASE_URL=$url "$bin" run --sink null --all-topics --worker-id "$label-$i" --statements "$statements" \
            --telemetry-addr "127.0.0.1:$((port + i))" 2>"$dir/$label-$i.log" &
        rp+=($!); pids+=($!)
    done
    until [ "$(sql 'SELECT count(*) FROM outbox.messages')" = 0 ]; do sleep 0.05; done
    end=$(date +%s.%N)
    local claim complete
    # The first relayer's view (the relayers are alike).
    claim=$(mean_ms "${addrs[0]}" outbox_claim_duration_seconds)
    complete=$(mean_ms "${addrs[0]}" outbox_complete_duration_seconds)
    kill "${rp[@]}"; wait "${rp[@]}" 2>/dev/null || true
    python3 -c "import sys; n,s,e=int(sys.argv[1]),float(sys.argv[2]),float(sys.argv[3]); print(f'{sys.argv[4]:<34} {n} messages in {e-s:5.2f} s = {n/(e-s):7.0f} msg/s; mean claim {sys.argv[5]} ms, completion {sys.argv[6]} ms')" \
        "$messages" "$start" "$end" "$label ($statements)" "$claim" "$complete"
    sql "TRUNCATE outbox.attempts"
}

# pickup LABEL ARGS...: one message at a time through the pooler, each after the previous was
# delivered; the median from enqueue (the UUIDv7's time) to the delivery's attempt.
pickup() {
    local label=$1; shift
    DATABASE_URL=$pooled "$bin" run --sink null --all-topics --worker-id "$label" --no-telemetry \
        --poll-interval-ms 5000 "$@" 2>"$dir/$label.log" &
    local r=$!; pids+=($r)
    sleep 3
    for _ in $(seq 1 40); do
        psql "$pooled" -XAtqc "SELECT outbox.enqueue('pickup', '{}'::jsonb)" >/dev/null
        until [ "$(sql 'SELECT count(*) FROM outbox.messages')" = 0 ]; do sleep 0.002; done
        # Idle again: past the rechecks that follow a wake-up (25, 100 and 400 ms).
        sleep 0.7
    done
    kill "$r"; wait "$r" 2>/dev/null || true
    sql "SELECT format('%-34s p50 %s ms, p90 %s ms (40 messages, poll interval 5 s)', '$label',
                round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1),
                round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 1))
           FROM (SELECT extract(epoch FROM created_at) * 1000
                        - ('x' || substr(replace(outbox_id::text, '-', ''), 1, 12))::bit(48)::bigint AS ms
                   FROM outbox.attempts) s"
    sql "TRUNCATE outbox.attempts"
}

echo "bench-poolers: PgBouncer $(/usr/sbin/pgbouncer --version | head -1 | awk '{print $2}') transaction mode; $relayers relayers, batch 500, 3 batches in flight, null destination; $(nproc) cores"
drain direct "$direct" named
drain direct "$direct" unnamed
drain "through PgBouncer" "$pooled" unnamed
drain direct "$direct" named
drain direct "$direct" unnamed
drain "through PgBouncer" "$pooled" unnamed
pickup "pickup, direct listen_url" --listen-url "$direct"
pickup "pickup, deaf listener (polling)"
