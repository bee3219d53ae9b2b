#!/usr/bin/env bash
# Pins landed migrations: appends `sha256sum` lines to schema/migrations.sha256 for the
# files of schema/migrations/ not pinned yet (`make pin-migrations`). With --check it
# changes nothing and fails naming each file that is not pinned, each pinned file whose
# content no longer matches its checksum (a landed migration edited: refinery would refuse
# every database that applied it) and each pinned file that is gone; it needs no build, so
# `make check` runs it first. tests/database/schema_contract.rs checks the same pins from Rust.
set -euo pipefail
cd "$(dirname "$0")/../schema/migrations"
check=false
[ "${1:-}" = --check ] && check=true
failed=0
if $check; then
    while read -r sum file; do
        if [ ! -f "$file" ]; then
            echo "schema/migrations/$file is pinned but missing: a landed migration is never removed" >&2
            failed=1
        elif [ "$(sha256sum "$file" | cut -d' ' -f1)" != "$sum" ]; then
            echo "schema/migrations/$file has changed since it was pinned: a landed migration is" \
                 "never edited (restore it with git checkout and put the change in a new migration)" >&2
            failed=1
        fi
    done <../migrations.sha256
fi
for f in $(ls V*__*.sql | sort -V); do
    grep -q "  $f\$" ../migrations.sha256 && continue
    if $check; then
        echo "schema/migrations/$f is not pinned: run make pin-migrations and commit schema/migrations.sha256" >&2
        failed=1
    else
        sha256sum "$f" >>../migrations.sha256
        echo "pinned $f"
    fi
done
exit $failed
