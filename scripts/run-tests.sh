#!/usr/bin/env bash
# Runs one tier of the test suite with cargo nextest: each test in a process of its own,
# both cores busy, every failure reported (.config/nextest.toml says which tests run alone).
#   scripts/run-tests.sh check      the unit tests and the suites that need Postgres alone
#                                   (tests/model, tests/database, tests/sql_api, tests/sources)
#   scripts/run-tests.sh services   every other test binary: the suites that need brokers,
#                                   emulators, PgBouncer, shells and the producers' toolchains
#                                   (tests/process, tests/destinations), then the doctests
#   scripts/run-tests.sh list       the count of tests of each tier, run by nobody
# Needs DATABASE_URL (scripts/with-postgres.sh sets it). The test databases are copies of
# one template migrated by the first test that needs it (OUTBOX_TEST_TEMPLATE, see
# tests/common); this script names it for the run and drops it when the run ends, passed or
# failed.
set -euo pipefail
cd "$(dirname "$0")/.."

tier=${1:?usage: scripts/run-tests.sh check|services|list}
shift
check=(--lib --bins --test model --test database --test sql_api --test sources)
# Every test the check tier does not run, so that a new test binary runs here by default.
services=(-E 'not (kind(lib) | kind(bin) | binary(model) | binary(database) | binary(sql_api) | binary(sources))')

if ! cargo nextest --version >/dev/null 2>&1; then
    echo "run-tests: cargo nextest is missing: cargo install cargo-nextest --locked" >&2
    exit 1
fi

if [ "$tier" = list ]; then
    for t in check services; do
        declare -n args=$t
        n=$(cargo nextest list "${args[@]}" --message-format oneline 2>/dev/null | grep -c .)
        echo "tests: $t tier: $n"
    done
    docs=$(cargo test --doc -- --list 2>/dev/null | grep -c ': test$' || true)
    echo "tests: doctests: $docs"
    exit 0
fi

server=${DATABASE_URL:?run-tests: DATABASE_URL is not set (run it under scripts/with-postgres.sh)}

# tests/database/previous_release.rs reads the previous release from the history: a shallow
# clone is deepened first when its origin answers (otherwise that test fails, naming why).
if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then
    echo "run-tests: this clone is shallow; fetching its history (the previous release's" \
         "statements are read from it)" >&2
    git fetch --quiet --unshallow || echo "run-tests: git fetch --unshallow failed" >&2
fi
export OUTBOX_TEST_TEMPLATE="outbox_test_template_$$_${RANDOM}"
drop_template() {
    psql "$server" -XAtq >/dev/null <<SQL || true
SELECT format('ALTER DATABASE %I IS_TEMPLATE false', datname) FROM pg_database
 WHERE datname IN ('$OUTBOX_TEST_TEMPLATE', '${OUTBOX_TEST_TEMPLATE}_building') \gexec
SELECT format('DROP DATABASE %I WITH (FORCE)', datname) FROM pg_database
 WHERE datname IN ('$OUTBOX_TEST_TEMPLATE', '${OUTBOX_TEST_TEMPLATE}_building') \gexec
SQL
}
trap drop_template EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

case $tier in
    check) cargo nextest run "${check[@]}" "$@" ;;
    services)
        cargo nextest run "${services[@]}" "$@"
        cargo test --doc
        ;;
    *) echo "run-tests: unknown tier $tier (check, services or list)" >&2; exit 2 ;;
esac
