#!/usr/bin/env bash
# Stops the servers that scripts/test-services.sh started (listed in
# target/test-services.started, one per line: `rabbitmq`, or a name, a pid or pid file, and
# optionally the scratch directory it ran in), by their pid, and nothing else: a server that
# was already running before stays up. The scratch directories go with them.
set -uo pipefail
cd "$(dirname "$0")/.."
started="${CARGO_TARGET_DIR:-target}/test-services.started"
[ -f "$started" ] || exit 0
while read -r name where scratch; do
    case "$name" in
        rabbitmq)
            echo "stop-test-services: stopping RabbitMQ (started for the tests)" >&2
            rabbitmqctl stop >/dev/null 2>&1 || true
            ;;
        *)
            pid=$where
            [ -f "$where" ] && pid=$(cat "$where")
            if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
                echo "stop-test-services: stopping $name (pid $pid, started for the tests)" >&2
                kill "$pid" 2>/dev/null || true
                for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            fi
            [ -f "$where" ] && rm -f "$where"
            case "$scratch" in /tmp/*) rm -rf "$scratch" ;; esac
            ;;
    esac
done <"$started"
rm -f "$started"
