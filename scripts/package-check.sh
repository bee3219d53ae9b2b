#!/usr/bin/env bash
# `make package-check`: the crate as `cargo publish` would upload it.
#   1. Its file list: what `cargo install` needs is in it (the code, build.rs, every
#      migration and area file the binary embeds, the peers benchmark's Node program, the
#      lock file, the README), and what stays in the repository is not (tests, docs, deploy,
#      scripts other than that program, target/).
#   2. The packaged copy builds: it is unpacked under target/package-check and built with
#      the tests' profile and target directory, so that the dependencies the tests built
#      are reused and only the crate itself compiles (`cargo publish --dry-run` builds the
#      whole tree again in a directory of its own). The build's uplifted binary
#      (target/debug/outbox-relay) is then the checkout's own again.
set -euo pipefail
cd "$(dirname "$0")/.."

name=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json,sys; p=json.load(sys.stdin)["packages"][0]; print(p["name"]+"-"+p["version"])')
list=$(cargo package --list --locked --allow-dirty)

missing=()
for f in Cargo.toml Cargo.lock README.md build.rs src/lib.rs src/bin/outbox-relay/main.rs scripts/peers/peers.mjs; do
    grep -qxF "$f" <<<"$list" || missing+=("$f")
done
for f in schema/migrations/*.sql schema/[0-9]*.sql schema/migrations.sha256; do
    grep -qxF "$f" <<<"$list" || missing+=("$f")
done
for f in $(git ls-files src); do
    grep -qxF "$f" <<<"$list" || missing+=("$f")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "package-check: the package lacks ${missing[*]} (the include list of Cargo.toml)" >&2
    exit 1
fi
stray=$(grep -P '^(tests|docs|deploy|target|examples|\.ci|\.github|\.config)/|^scripts/(?!peers/peers\.mjs$)' <<<"$list" || true)
if [ -n "$stray" ]; then
    echo "package-check: the package ships files that stay in the repository:" >&2
    echo "$stray" >&2
    exit 1
fi
echo "package-check: $(wc -l <<<"$list") files in $name.crate"

cargo package --locked --allow-dirty --no-verify --quiet
target=${CARGO_TARGET_DIR:-target}
dir=$target/package-check
rm -rf "$dir/$name"
mkdir -p "$dir"
tar -xzf "$target/package/$name.crate" -C "$dir"
# --all-targets: the unit tests' targets bring in the dev-dependencies' features, as the
# tests' build did, so that the same dependency builds serve both.
cargo build --locked --all-targets --manifest-path "$dir/$name/Cargo.toml" --target-dir "$target"
rm -rf "$dir/$name"
# The checkout's binary back in target/debug (the tests and `make chaos` run it).
cargo build --locked --all-targets
echo "package-check: the packaged $name builds"
