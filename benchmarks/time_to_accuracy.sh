#!/usr/bin/env bash
# Time-to-accuracy from a cold start with the shipped recipes (the README's "Results" table): Inductor's on-disk
# cache is emptied first (as in every README number; KEEP_CACHE=1 keeps it), and the wall time is printed at the end.
# usage: bash benchmarks/time_to_accuracy.sh [fmnist5|fmnist30|cifar30|digits]
set -euo pipefail
case "${1:-digits}" in
  digits)   cmd=(vitkit train --output runs/tta-digits) ;;
  fmnist5)  cmd=(vitkit train --dataset fashion-mnist --time-limit 5 --output runs/tta-fmnist5) ;;
  fmnist30) cmd=(vitkit train --dataset fashion-mnist --time-limit 30 --output runs/tta-fmnist30) ;;
  cifar30)  cmd=(vitkit train --dataset folder --data-dir ../shared/data/cifar10-jpg.zip --time-limit 30
                 --output runs/tta-cifar30) ;;
  *) echo "unknown: $1" >&2; exit 2 ;;
esac
if [ "${KEEP_CACHE:-0}" != 1 ]; then
  rm -rf "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}"
fi
start=$(date +%s.%N)
"${cmd[@]}"
end=$(date +%s.%N)
echo "wall: $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$start" "$end")"
