#!/usr/bin/env bash
# Runs a command with the servers the tests need (scripts/test-services.sh starts what is
# down and installs what is missing), then stops the servers it started, whether the
# command passed, failed or was interrupted; servers that were already running stay up.
# The cluster-wide roles the migrations create (outbox_relay, outbox_producer,
# outbox_reader) are dropped afterwards when the run created them and no database still
# uses them (a failed test's kept database does, and keeps them).
# Usage: scripts/with-test-services.sh COMMAND [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."

server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
roles_before=
if command -v psql >/dev/null 2>&1 && psql "$server" -XAtqc 'SELECT 1' >/dev/null 2>&1; then
    roles_before=$(psql "$server" -XAtqc "SELECT string_agg(rolname, ' ') FROM pg_roles
        WHERE rolname IN ('outbox_relay', 'outbox_producer', 'outbox_reader')")
    roles_before=${roles_before:-none}
fi
finish() {
    scripts/stop-test-services.sh
    [ -n "$roles_before" ] || return 0
    local created=()
    for role in outbox_relay outbox_producer outbox_reader; do
        case " $roles_before " in *" $role "*) ;; *) created+=("$role") ;; esac
    done
    [ ${#created[@]} -eq 0 ] || scripts/drop-outbox-roles.sh "$server" "${created[@]}"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
scripts/test-services.sh
# Programs test-services.sh unpacked under the target directory instead of upgrading an
# installed package (see there).
mkdir -p "${CARGO_TARGET_DIR:-target}"
export PATH="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debs/bin:$PATH"
# The AWS destination tests run against moto servers of their own, which check no signature;
# the relayer's AWS SDK still signs, with these (never the caller's own credentials).
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing
unset AWS_SESSION_TOKEN AWS_PROFILE
"$@"
