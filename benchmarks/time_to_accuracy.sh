#!/usr/bin/env bash
# Time-to-accuracy from a cold start with the shipped recipes (docs/results.md, results/time-to-accuracy.csv): `vitkit bench
# --time-to-accuracy RUN` runs the row's `vitkit train` command in a fresh process with an empty Inductor cache (a new
# cache folder for that process; KEEP_CACHE=1 keeps the usual one) and prints top-1, epochs and the wall time.
# usage: bash benchmarks/time_to_accuracy.sh [digits|fmnist5|fmnist30|cifar30] [more vitkit bench flags]
set -euo pipefail
run=${1:-digits}
shift || true
extra=()
if [ "${KEEP_CACHE:-0}" = 1 ]; then extra+=(--keep-cache); fi
exec vitkit bench --time-to-accuracy "$run" "${extra[@]}" "$@"
