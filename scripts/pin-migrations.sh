#!/usr/bin/env bash
# Pins landed migrations: appends `sha256sum` lines to schema/migrations.sha256 for the
# files of schema/migrations/ not pinned yet (`make pin-migrations`). With --check it
# changes nothing and fails naming each unpinned file (`make lint`), so every migration
# lands pinned; tests/schema_contract.rs checks the pinned ones are unchanged.
set -euo pipefail
cd "$(dirname "$0")/../schema/migrations"
check=false
[ "${1:-}" = --check ] && check=true
unpinned=0
for f in $(ls V*__*.sql | sort -V); do
    grep -q "  $f\$" ../migrations.sha256 && continue
    if $check; then
        echo "schema/migrations/$f is not pinned: run make pin-migrations and commit schema/migrations.sha256" >&2
        unpinned=1
    else
        sha256sum "$f" >>../migrations.sha256
        echo "pinned $f"
    fi
done
exit $unpinned
