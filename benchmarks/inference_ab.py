"""vitkit's default inference (``optimize_for_inference(model)``) against the peers in the dtype vitkit chose here
(bf16 weights where its timing took bf16, else fp32: each peer's fastest on that CPU), the whole forward of vitkit's
own model, and the linear layers' bias in vs after the matmul: paired rounds in one process, the order of each round
rotated, the ratio taken within each round so that the machine's drift (10-25% over minutes on a shared 2-core
machine) cancels.

    python benchmarks/inference_ab.py [--model vit_base_patch16_224] [--batch 16] [--rounds 8] [--profile]
    python benchmarks/inference_ab.py --peers timm hf torchvision onnxruntime --csv results/inference-vit-b16.csv

``--profile`` then runs PyTorch's profiler over two forwards of vitkit's default and of the first peer: where the
time goes, operator by operator (the matmuls against the rest).

Not a test: numbers, no assertions. Run nothing else on the machine meanwhile.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

import vitkit
from vitkit.bench.inference import FP32_ONLY, PEERS, _runner
from vitkit.bench.timing import round_robin_times
from vitkit.runtime.cpu import cpu_kind_short, machine_name
from vitkit.runtime.inference import split_bias

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import append_csv_rows, cpu_label, csv_arg  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--rounds", type=int, default=8, help="timed rounds; each runs every variant once")
p.add_argument("--peers", nargs="+", default=["timm", "torchvision"], choices=sorted(PEERS))
p.add_argument("--profile", action="store_true", help="also profile two forwards of vitkit's default and a peer")
p.add_argument("--csv", type=csv_arg, default=None, help="append the rows to this CSV (results/inference-vit-b16.csv)")
args = p.parse_args()
if args.rounds < 1 or args.batch < 1:
    p.error("--rounds and --batch must be at least 1")

torch.manual_seed(0)
model = vitkit.create_model(args.model).eval()
with torch.no_grad():
    model.head.weight.normal_(0, 0.02)
x = torch.randn(args.batch, 3, *(model.config.img_size,) * 2)
t0 = time.perf_counter()
auto = vitkit.optimize_for_inference(model, batch_size=args.batch)
print(f"optimize_for_inference chose: {auto.calibration.best.name} ({time.perf_counter() - t0:.1f} s, "
      f"{'cached' if auto.calibration.cached else 'timed here'})\n{auto.calibration.table()}")
mode = "fp32" if auto.dtype is None else "bf16-weights"
bias = copy.deepcopy(auto)  # the chosen dtype and path with the bias the other way
split = not isinstance(auto.model.blocks[0].mlp.fc1, torch.nn.Linear)
if not split:
    split_bias(bias.model)
whole = copy.deepcopy(model).to(auto.dtype or torch.float32)  # every token of the last layer too
whole.set_attention(auto.model.blocks[0].attn.impl)
xs = x.to(auto.dtype or torch.float32)
variants = {"vitkit default": lambda: auto(x),
            f"vitkit, bias {'in' if split else 'after'} the matmul": lambda: bias(x),
            "vitkit, every token of the last layer (no readout)": _runner(whole, xs, "fp32")}
for name in args.peers:
    peer = PEERS[name](model)
    if peer is None or (name in FP32_ONLY and mode != "fp32"):
        print(f"  ({name}: not installed, or fp32 only)")
        continue
    variants[f"{name} {mode}"] = _runner(peer.eval(), x, mode)
times = dict(zip(variants, round_robin_times(list(variants.values()), repeats=args.rounds)))
where = f"{machine_name(torch.device('cpu'))}, {torch.get_num_threads()} threads"
print(f"\n{args.model} batch {args.batch}, {where}, {args.rounds} rounds")


def paired(a: str, b: str) -> tuple[float, str]:
    ratios = [tb / ta for ta, tb in zip(times[a], times[b])]  # > 1: a is faster
    return statistics.median(ratios), f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"


peers = [n for n in times if n.split()[0] in args.peers]
best = max(peers, key=lambda n: statistics.median([1 / t for t in times[n]]), default=None)
rows = []
for name, ts in times.items():
    said = "" if name == "vitkit default" else f"   vitkit default is {paired('vitkit default', name)[1]}"
    print(f"  {name:<28} {args.batch / statistics.median(ts):7.2f} img/s{said}")
    vs = round(paired("vitkit default", best)[0], 3) if name == "vitkit default" and best else ""
    rows.append({"cpu_kind": cpu_kind_short(), "cpu": cpu_label(), "implementation": name,
                 "dtype": f"{auto.precision} ({auto.calibration.best.name})" if name == "vitkit default" else mode,
                 "img_per_s": round(args.batch / statistics.median(ts), 2), "vs_best_peer": vs,
                 "command": "python benchmarks/inference_ab.py " + " ".join(sys.argv[1:]),
                 "source": f"measured {time.strftime('%Y-%m-%d')}, round-robin in one process; vs_best_peer: the "
                           f"median per-round ratio against the fastest peer ({best})"})
if args.csv:
    append_csv_rows(args.csv, rows)

if args.profile:
    from torch.profiler import ProfilerActivity, profile

    for name in ("vitkit default", next(n for n in variants if n.startswith(args.peers[0]))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            variants[name]()
            variants[name]()
        print(f"\n{name}: two forwards")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
