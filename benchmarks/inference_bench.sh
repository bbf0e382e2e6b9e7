#!/usr/bin/env bash
# Inference and training throughput against timm / Hugging Face / torchvision, plus the matmul ceiling.
# usage: bash benchmarks/inference_bench.sh [JSON_OUT]
set -euo pipefail
vitkit bench --json "${1:-runs/bench.json}"
