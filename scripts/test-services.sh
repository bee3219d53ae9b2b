#!/usr/bin/env bash
# What `make test` needs besides Postgres (scripts/with-postgres.sh provides that):
#   - redis-server and nats-server binaries (destination tests start servers of their own);
#   - RabbitMQ answering on 127.0.0.1:5672 (tests put a proxy of their own in front of it);
#   - promtool (a test checks a live /metrics with `promtool check metrics`).
# Starts RabbitMQ, and the machine's Redis (6379) and NATS (4222) that `make bench` uses,
# when they are installed but down; installs promtool with apt-get when missing (as root).
# Anything still missing fails here, naming the server and the command that provides it.
set -euo pipefail

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
missing=()

if ! answers 5672 && command -v rabbitmq-server >/dev/null 2>&1; then
    echo "test-services: starting RabbitMQ" >&2
    rabbitmq-server -detached || true
fi
if ! answers 6379 && command -v redis-server >/dev/null 2>&1; then
    echo "test-services: starting Redis" >&2
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
if ! answers 4222 && [ -x /usr/sbin/nats-server ]; then
    echo "test-services: starting NATS with JetStream" >&2
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log || true
fi
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test-services: installing promtool (Debian package prometheus)" >&2
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

for _ in $(seq 1 60); do answers 5672 && break; sleep 1; done
answers 5672 || missing+=("RabbitMQ on 127.0.0.1:5672 (apt-get install rabbitmq-server; start: rabbitmq-server -detached)")
command -v redis-server >/dev/null 2>&1 || missing+=("redis-server (apt-get install redis-server)")
[ -x /usr/sbin/nats-server ] || missing+=("/usr/sbin/nats-server (apt-get install nats-server)")
command -v promtool >/dev/null 2>&1 || missing+=("promtool (apt-get install prometheus)")
if [ ${#missing[@]} -gt 0 ]; then
    echo "test-services: the tests need:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 1
fi
