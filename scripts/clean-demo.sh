#!/usr/bin/env bash
# `make clean-demo`: removes what `make run` created on the server of DATABASE_URL: the
# database `outbox_demo` (DEMO_DATABASE), and the roles outbox_relay, outbox_producer and
# outbox_reader unless another database still uses them (roles are cluster-wide; those
# are kept and named). Run it through scripts/with-postgres.sh, which provides DATABASE_URL.
set -euo pipefail
demo=${DEMO_DATABASE:-outbox_demo}
case "$demo" in
    *[!a-z0-9_]* | "") echo "clean-demo: DEMO_DATABASE must be a lower-case SQL name, got '$demo'" >&2; exit 2 ;;
esac
server_url=${DATABASE_URL:?DATABASE_URL is not set: run through scripts/with-postgres.sh}
psql "$server_url" -Xqc "DROP DATABASE IF EXISTS $demo WITH (FORCE)"
echo "clean-demo: dropped database $demo (if it existed)" >&2
for role in outbox_relay outbox_producer outbox_reader; do
    exists=$(psql "$server_url" -XAtqc "SELECT 1 FROM pg_roles WHERE rolname = '$role'")
    [ "$exists" = 1 ] || continue
    if psql "$server_url" -Xq -v ON_ERROR_STOP=1 -c "DROP ROLE $role" 2>/dev/null; then
        echo "clean-demo: dropped role $role" >&2
    else
        echo "clean-demo: kept role $role: another database of this server still grants it rights" >&2
    fi
done
