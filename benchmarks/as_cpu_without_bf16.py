"""Run a vitkit command on a CPU with native bf16 (AMX/AVX512-BF16) as it runs on one without: every "does this
device multiply bf16 natively?" answers no, so ``precision: auto`` trains in fp32 and Muon orthogonalises in fp32,
as on the AVX-512-only and AVX2-only kinds. The kernels stay this CPU's (for the AVX-512-only kind's fp32 kernels
that is exact on an AMX Xeon; add ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``
for an AVX2-only instruction set; Inductor's generated code is then limited to 256-bit vectors too).

    python benchmarks/as_cpu_without_bf16.py train --dataset fashion-mnist --time-limit 5

With the AVX2 limits and ``--threads 1`` this Xeon also runs at about the AMD EPYC's *speed*: a 2048^3 fp32 matmul
at 102-111 GFLOP/s (``vitkit.bench.timing.matmul_ceiling(torch.float32, 2048)`` with ``OMP_NUM_THREADS=1``), where
the EPYC (AVX2 only, 2 cores) measured 118-125 GFLOP/s; elementwise kernels and the memory
bandwidth of one core are still slower than two of the EPYC's, so this errs on the slow side.
"""
import os
import sys

import torch._inductor.config as inductor_config

import vitkit.runtime.precision as precision

if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    inductor_config.cpp.simdlen = 256

precision.cpu_has_native_bf16 = lambda: False  # has_native_bf16, resolve_precision, emulates_bf16 all ask this
from vitkit.cli.main import main  # noqa: E402

raise SystemExit(main(sys.argv[1:]))
