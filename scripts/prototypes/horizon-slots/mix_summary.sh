#!/usr/bin/env bash
# Runs drain_mix.sh N times and prints, per release and run, the mean time per batch of 500
# of the claim, of the completion and of both (ms).
# usage: mix_summary.sh N MIGRATIONS_DIR [MESSAGES] [TXNS]
set -euo pipefail
n=$1; shift
for i in $(seq 1 "$n"); do
  "$(dirname "$0")/drain_mix.sh" "$@" 2>&1 | grep -E "^SQL script|latency average|^ +[0-9.]+ +[0-9]+ +SELECT|FAILED|error" | grep -v "^latency" |
    awk '/^SQL script/ {v=$4; sub(/.*drain_/, "V", v); sub(/\.sql/, "", v)} /latency average/ {t=$5}
         /FAILED|error/ {print; next}
         /SELECT count/ {c=$1} /complete_all/ {printf "%s claim %.2f complete %.2f total %.2f\n", v, c, $1, t}'
done
