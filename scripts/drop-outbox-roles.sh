#!/usr/bin/env bash
# Drops the named outbox roles (outbox_relay, outbox_producer, outbox_reader) from the
# server of the given URL, each unless a database of that server still grants it rights,
# and says which it dropped and which it kept. Roles are cluster-wide: `make clean-demo`
# and the end of `make test` use this for the roles they created.
# Usage: scripts/drop-outbox-roles.sh SERVER_URL ROLE...
set -uo pipefail
server_url=$1
shift
for role in "$@"; do
    exists=$(psql "$server_url" -XAtqc "SELECT 1 FROM pg_roles WHERE rolname = '$role'")
    [ "$exists" = 1 ] || continue
    if psql "$server_url" -Xq -v ON_ERROR_STOP=1 -c "DROP ROLE $role" 2>/dev/null; then
        echo "dropped role $role" >&2
    else
        echo "kept role $role: a database of this server still grants it rights" >&2
    fi
done
