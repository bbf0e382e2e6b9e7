#!/usr/bin/env bash
# Paper §3.2 in miniature on real digits: train at 32 px; evaluate at 32, 40 and 48 px with the position
# embeddings resampled in 2-D; then fine-tune briefly at 48 px from those weights (--init) as the paper does.
# usage: bash benchmarks/resolution_transfer.sh [OUT_DIR]
case "${1:-}" in -h|--help) sed -n "2,$((4))p" "$0" | sed "s/^# \{0,1\}//"; exit 0 ;; esac
set -euo pipefail
out=${1:-runs/resolution-transfer}
vitkit train --dataset digits --img-size 32 --patch-size 8 --output "$out"
for size in 32 40 48; do
  echo "== trained at 32px, evaluated at ${size}px"
  vitkit eval --checkpoint "$out/best" --img-size "$size" --out "$out/eval-$size" | grep top-1
done
vitkit train --dataset digits --init "$out/best" --img-size 48 --epochs 5 --warmup-epochs 0.5 --lr 3e-4 \
  --output "$out-ft48" | grep final
echo "== fine-tuned 5 epochs at 48px"
vitkit eval --checkpoint "$out-ft48/best" --out "$out-ft48/eval" | grep top-1
