#!/usr/bin/env bash
# Time-to-accuracy from a cold start with the shipped recipes (the README's "Results" table).
# usage: bash benchmarks/time_to_accuracy.sh [fmnist5|fmnist30|cifar30|digits]
set -euo pipefail
case "${1:-digits}" in
  digits)   vitkit train --output runs/tta-digits ;;
  fmnist5)  vitkit train --dataset fashion-mnist --time-limit 5 --output runs/tta-fmnist5 ;;
  fmnist30) vitkit train --dataset fashion-mnist --time-limit 30 --output runs/tta-fmnist30 ;;
  cifar30)  vitkit train --dataset folder --data-dir ../shared/data/cifar10-jpg.zip --time-limit 30 --output runs/tta-cifar30 ;;
  *) echo "unknown: $1" >&2; exit 2 ;;
esac
