#!/usr/bin/env bash
# Paper §3.2 in miniature: train at 32 px, evaluate at 32 and at 48 px (position embeddings resampled in 2-D).
# usage: bash benchmarks/resolution_transfer.sh [OUT_DIR]
set -euo pipefail
out=${1:-runs/resolution-transfer}
vitkit train --dataset digits --img-size 32 --patch-size 8 --output "$out"
for size in 32 40 48; do
  echo "== evaluated at ${size}px"
  vitkit eval --checkpoint "$out/best" --img-size "$size" --out "$out/eval-$size" | grep top-1
done
