"""The optimiser step alone, round-robin in one process: fused AdamW, torch.optim.Muon (Newton-Schulz in bf16
always), and vitkit's Muon with the iterations in fp32 and in bf16, over the hidden weight matrices of a Fashion-MNIST
recipe model (the rest of the model under AdamW, as the trainer splits it).

    python benchmarks/muon_step.py [--depth 3] [--steps 20] [--csv results/muon-step.csv]

On a CPU without native bf16 torch.optim.Muon's bf16 matmuls are emulated: stand in for such CPUs on an AMX Xeon with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (AVX-512 without bf16) or ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2`` (AVX2 only). Not a test: numbers, no assertions.
"""
import argparse
import time

import torch

import vitkit
from _helpers import append_csv_rows, cpu_label, csv_arg, fashion_mnist_vit_config
from vitkit.training.config import TrainConfig
from vitkit.training.optim import Muon, MuonAdamW, build_optimizer, param_groups

p = argparse.ArgumentParser()
p.add_argument("--depth", type=int, default=3, help="3: the 5-minute recipe's model, 6: the 30-minute one")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--csv", type=csv_arg, help="append the rows to this CSV (with the CPU kind and this command)")
args = p.parse_args()

cfg = fashion_mnist_vit_config(args.depth, "conv:32,32")
train_cfg = TrainConfig(opt="muon", lr=0.002, weight_decay=0.05)


def make(kind: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = vitkit.VisionTransformer(cfg)
    if kind == "adamw (fused)":
        opt = build_optimizer(model, TrainConfig(opt="adamw", lr=0.002))
    else:
        opt = MuonAdamW(model, param_groups(model, train_cfg), train_cfg.lr, fused=True)
        groups = opt.muon.param_groups
        if kind == "torch.optim.Muon (bf16)":
            opt.muon = torch.optim.Muon(groups, lr=train_cfg.lr, adjust_lr_fn="match_rms_adamw")
        else:
            opt.muon = Muon(groups, lr=train_cfg.lr, ns_dtype=torch.float32 if "fp32" in kind else torch.bfloat16)
        opt.optimizers[0] = opt.muon
    for q in model.parameters():
        q.grad = torch.randn_like(q)

    def run() -> None:
        for _ in range(args.steps):
            opt.step()
    return run


KINDS = ("adamw (fused)", "torch.optim.Muon (bf16)", "vitkit Muon (fp32)", "vitkit Muon (bf16)")
runs = [make(k) for k in KINDS]
times: list[list[float]] = [[] for _ in KINDS]
for r in range(args.repeats + 1):
    for run, ts in zip(runs, times):
        t = time.perf_counter()
        run()
        if r:  # the first round warms up
            ts.append((time.perf_counter() - t) / args.steps * 1e3)
cpu = cpu_label()
print(f"{cpu}; depth {args.depth}; ms per optimiser step (median of {args.repeats})")
rows = []
for k, ts in zip(KINDS, times):
    ms = sorted(ts)[len(ts) // 2]
    print(f"  {k:26s} {ms:8.2f} ms")
    rows.append({"cpu": cpu, "model": f"Fashion-MNIST, depth {args.depth}, conv:32,32", "optimizer": k,
                 "ms_per_step": round(ms, 2)})
if args.csv:
    append_csv_rows(args.csv, rows)
