"""Pre-training's training step against supervised training's, round-robin in one process: the same encoder (the
plain ViT that ``vitkit reproduce self-supervision`` pre-trains: CIFAR-10 at 32 px, patch 4, width 128, depth 6),
the same batch, precision and optimiser (AdamW), and the objective's own step: ``classify`` (the head's
cross-entropy), ``mae`` (the encoder sees the visible quarter of the patches; the decoder restores all of them) and
``mpp`` (every patch through the encoder, half of them corrupted, a colour head).

    python benchmarks/pretrain_speed.py [--model vit|hybrid] [--batch 128] [--precision bf16] [--steps 10]
                                        [--repeats 5] [--compile] [--csv results/pretrain-speed.csv]
                                        [--attention sdpa|exact] [--profile 8]

``--model hybrid``: configs/cifar10.yaml's own model (the conv:64,64,M,128,128,M stem, then 4 blocks), pre-trained
with its stem on each visible cell alone for MAE and masked at every layer for MPP (model/masked_stem.py).

Forward, backward and optimiser step on a batch already in memory: what the objective costs, not the data
pipeline (which is the same code for all three). The issue's target: pre-training at >= 90% of supervised
training's img/s. Not a test: numbers, no assertions.

``--profile N``: after the timing, one more round of each objective under torch.profiler, and its N operators of
most self time with their share of the round: where a step's time goes (``--model hybrid --batch 256 --attention
exact --profile 6`` on a 2-core AMD EPYC with AVX512-BF16, bf16 the faster: MAE's step 21.9% in the convolutions'
backward over the visible cells).
"""
import argparse
import statistics
import time

import torch

import vitkit
from _helpers import append_csv_rows, cpu_label, csv_arg
from vitkit.cli.common import positive_int
from vitkit.data.augment import BatchAugment
from vitkit.model.vit import set_attention
from vitkit.reproduce.claims import models
from vitkit.runtime.precision import autocast_for
from vitkit.training.config import TrainConfig, read_recipe
from vitkit.training.objectives import objective_for
from vitkit.training.optim import build_optimizer

p = argparse.ArgumentParser()
p.add_argument("--model", choices=("vit", "hybrid"), default="vit",
               help="the claim's plain ViT, or the CIFAR-10 recipe's hybrid")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
p.add_argument("--steps", type=int, default=10, help="steps a round")
p.add_argument("--repeats", type=int, default=5, help="rounds (after one of warm-up)")
p.add_argument("--attention", choices=("sdpa", "exact"), default="sdpa",
               help="the attention the step computes with; the training planner times both and takes the faster "
                    "(exact on a 2-core AMD EPYC: 467 ms against sdpa's 675 for the hybrid's supervised step)")
p.add_argument("--compile", action="store_true", help="torch.compile each objective's module first")
p.add_argument("--profile", type=positive_int, default=0, metavar="N",
               help="then profile one round of each objective: its N operators of most self time")
p.add_argument("--csv", type=csv_arg, help="append the rows to this CSV (with the CPU kind and this command)")
args = p.parse_args()

spec = models("cifar10")["vit"] if args.model == "vit" else \
    {"model": read_recipe("cifar10")["model"], "model_args": read_recipe("cifar10")["model_args"]}
OBJECTIVES = ("classify", "mae", "mpp")
# what the CSV's rows name MPP's hybrid step by (the rows before it masked with elementwise operations)
MPP_STEM = "masked at every layer, conv-BN-ReLU as one Function; head on the corrupted patches"
device = torch.device("cpu")
mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def make(objective: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = vitkit.create_model(spec["model"], num_classes=10, **spec["model_args"])
    set_attention(model, args.attention)
    cfg = TrainConfig(objective=objective, opt="adamw", lr=1e-3, weight_decay=0.05)
    obj = objective_for(cfg, BatchAugment(mean, std, (32, 32), 10))
    module = obj.wrap(model).train()
    opt = build_optimizer(module, cfg)
    fwd = torch.compile(module) if args.compile else module
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    def run() -> None:
        for _ in range(args.steps):
            with autocast_for(device, args.precision):
                loss = obj.loss(fwd, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


runs = [make(o) for o in OBJECTIVES]
times: list[list[float]] = [[] for _ in OBJECTIVES]
for r in range(args.repeats + 1):  # the first round warms up (and compiles): not counted
    for run, ts in zip(runs, times):
        t = time.perf_counter()
        run()
        if r:
            ts.append(time.perf_counter() - t)

ips = {o: args.batch * args.steps / statistics.median(ts) for o, ts in zip(OBJECTIVES, times)}
cpu = cpu_label()
rows = []
for o, ts in zip(OBJECTIVES, times):
    spread = [args.batch * args.steps / t for t in ts]
    stems = {"mae_stem": "each visible cell alone", "mpp_stem": MPP_STEM} if args.model == "hybrid" else {}
    rows.append({"cpu": cpu, "model": args.model, "objective": o, **stems, "attention": args.attention,
                 "batch": args.batch, "precision": args.precision, "compiled": args.compile,
                 "img_per_s": round(ips[o], 1), "img_per_s_range": f"{min(spread):.0f}-{max(spread):.0f}",
                 "vs_classify": round(ips[o] / ips["classify"], 3)})
    print(f"{o:9s} {ips[o]:8.1f} img/s ({min(spread):.0f}-{max(spread):.0f} over {args.repeats} rounds)  "
          f"{ips[o] / ips['classify']:.2f}x supervised")
print(f"{cpu}; {args.model}, batch {args.batch}, {args.precision}, attention {args.attention}, "
      f"{'compiled' if args.compile else 'eager'}")
if args.csv:
    append_csv_rows(args.csv, rows)
if args.profile:
    for o, run in zip(OBJECTIVES, runs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        print(f"\n{o}: {total / 1e3 / args.steps:.0f} ms of operator time a step; the {args.profile} of most self "
              "time:")
        for e in ops[:args.profile]:
            print(f"  {e.self_cpu_time_total / total:6.1%}  {e.self_cpu_time_total / 1e3 / args.steps:7.1f} ms/step  "
                  f"{e.count // args.steps:3d} calls/step  {e.key}")
