#!/usr/bin/env bash
# Runs a command with the servers the tests need (scripts/test-services.sh starts what is
# down and installs what is missing), then stops the servers it started, whether the
# command passed, failed or was interrupted; servers that were already running stay up.
# Usage: scripts/with-test-services.sh COMMAND [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'scripts/stop-test-services.sh' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
scripts/test-services.sh
"$@"
