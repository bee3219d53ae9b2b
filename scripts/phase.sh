#!/usr/bin/env bash
# Runs a command as one named phase of a check: announces it, then prints its seconds when
# it ends. With CI_PHASES naming a file, also appends "NAME<TAB>SECONDS<TAB>RESULT" to it,
# which .ci/run prints as a table at its end.
# Usage: scripts/phase.sh NAME COMMAND [ARGS...]
set -uo pipefail
name=${1:?usage: scripts/phase.sh NAME COMMAND [ARGS...]}
shift
echo "phase $name: $*" >&2
start=$(date +%s)
"$@"
status=$?
secs=$(($(date +%s) - start))
result=passed
[ "$status" = 0 ] || result="failed (exit $status)"
if [ -n "${CI_PHASES:-}" ]; then
    printf '%s\t%s\t%s\n' "$name" "$secs" "$result" >>"$CI_PHASES"
fi
echo "phase $name: $result in ${secs} s" >&2
exit "$status"
