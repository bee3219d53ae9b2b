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
"$(dirname "$0")/drop-outbox-roles.sh" "$server_url" outbox_relay outbox_producer outbox_reader
