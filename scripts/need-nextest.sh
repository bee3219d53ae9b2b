#!/usr/bin/env bash
# The test runner of `make check` and `make test` (scripts/run-tests.sh): cargo-nextest.
# Installed with `cargo install cargo-nextest --locked` (into ~/.cargo/bin, once per
# machine; a few minutes of compiling) when this machine lacks it.
set -euo pipefail
cargo nextest --version >/dev/null 2>&1 && exit 0
echo "need-nextest: installing cargo-nextest with cargo install into ~/.cargo/bin (the tests'" \
     "runner: one process per test on every core; a few minutes of compiling, once per machine)" >&2
cargo install cargo-nextest --locked
