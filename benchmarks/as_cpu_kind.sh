#!/usr/bin/env bash
# Run a command on this x86 CPU as one of the smaller kinds the project meets:
#   avx2    AVX2 only (the AMD EPYC kind: no AVX-512, VNNI, AMX or AVX512-BF16)
#   avx512  AVX-512 without VNNI, AMX or AVX512-BF16 (a Skylake-SP Xeon)
#   avx512vnni  the same with AVX512-VNNI (a Cascade Lake Xeon)
# Every library that asks the CPU what it has (PyTorch's dispatch, oneDNN, MKL, Inductor, onnxruntime's MLAS) gets a
# cpuid answer with those bits cleared (cpuid_mask.c, loaded with LD_PRELOAD) and picks that kind's code.
# What it measures is "emulated": the instructions are the smaller kind's; the cores, caches and clock stay this machine's (on the AMX Xeon, 2
# threads run a 2048^3 fp32 matmul at ~210-220 GFLOP/s as AVX2, the EPYC at 118-125: add OMP_NUM_THREADS=1 for its
# speed).
#
#   bash benchmarks/as_cpu_kind.sh avx2 vitkit bench --no-train --models vit_base_patch16_224 --batches 16
#
# Needs Linux on a CPU that can make cpuid fault (the cpuid_fault flag: Intel since Ivy Bridge, also in VMs) and gcc.
set -euo pipefail
kind=${1:-}
case "$kind" in
    avx2|avx512|avx512vnni) shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: as_cpu_kind.sh {avx2|avx512|avx512vnni} COMMAND [ARGS...]" >&2; exit 2 ;;
esac
if ! grep -qw cpuid_fault /proc/cpuinfo; then
    echo "as_cpu_kind.sh: this CPU or kernel cannot make cpuid fault (no cpuid_fault in /proc/cpuinfo)" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
lib=${XDG_CACHE_HOME:-$HOME/.cache}/vitkit/cpuid_mask.so
if [ ! "$lib" -nt "$here/cpuid_mask.c" ]; then
    mkdir -p "$(dirname "$lib")"
    gcc -O2 -shared -fPIC -o "$lib" "$here/cpuid_mask.c"
fi
VITKIT_AS_CPU=$kind LD_PRELOAD="$lib" exec "$@"
