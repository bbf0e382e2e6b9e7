"""vitkit's default inference (``optimize_for_inference(model)``) against the fastest peer found by `vitkit bench`
(torchvision with bf16 weights on CPUs with fast bf16), and the linear layers' bias in vs after the matmul: paired
rounds in one process, the order of each round rotated, the ratio taken within each round so that the machine's
drift (10-25% over minutes on a shared 2-core machine) cancels.

    python benchmarks/inference_ab.py [--model vit_base_patch16_224] [--batch 16] [--rounds 16] [--profile]

``--profile`` then runs PyTorch's profiler over two forwards of vitkit's default and of the peer: where the time goes,
operator by operator (the matmuls against the rest).

Not a test: numbers, no assertions. Run nothing else on the machine meanwhile.
"""
import argparse
import copy
import statistics

import torch

import vitkit
from vitkit.bench.inference import PEERS, _runner
from vitkit.bench.timing import round_robin_times
from vitkit.runtime.cpu import machine_name
from vitkit.runtime.inference import split_bias

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--rounds", type=int, default=16, help="timed rounds; each runs every variant once")
p.add_argument("--peer", default="torchvision", choices=sorted(PEERS))
p.add_argument("--profile", action="store_true", help="also profile two forwards of vitkit's default and the peer")
args = p.parse_args()
if args.rounds < 1 or args.batch < 1:
    p.error("--rounds and --batch must be at least 1")

torch.manual_seed(0)
model = vitkit.create_model(args.model).eval()
with torch.no_grad():
    model.head.weight.normal_(0, 0.02)
x = torch.randn(args.batch, 3, *(model.config.img_size,) * 2)
auto = vitkit.optimize_for_inference(model, batch_size=args.batch)
print(f"optimize_for_inference chose: {auto.calibration.best.name}\n{auto.calibration.table()}")
addmm = vitkit.optimize_for_inference(model, dtype=auto.dtype)  # the same dtype, the bias inside the matmul
addmm.model.set_attention(auto.model.blocks[0].attn.impl)
split = copy.deepcopy(addmm)
split_bias(split.model)
peer = PEERS[args.peer](model).eval()
variants = {"vitkit default": lambda: auto(x), "bias in the matmul": lambda: addmm(x),
            "bias after the matmul": lambda: split(x),
            f"{args.peer} bf16 weights": _runner(peer, x, "bf16-weights")}
times = dict(zip(variants, round_robin_times(list(variants.values()), repeats=args.rounds)))
print(f"\n{args.model} batch {args.batch}, {machine_name(torch.device('cpu'))}, {torch.get_num_threads()} threads, "
      f"{args.rounds} rounds")
for name, ts in times.items():
    print(f"  {name:<28} {args.batch / statistics.median(ts):7.2f} img/s")


def paired(a: str, b: str) -> str:
    ratios = [tb / ta for ta, tb in zip(times[a], times[b])]  # > 1: a is faster
    return f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"


print(f"  vitkit default vs {args.peer}: {paired('vitkit default', f'{args.peer} bf16 weights')} (median of the "
      "per-round speed ratios)")
print(f"  bias after vs in the matmul: {paired('bias after the matmul', 'bias in the matmul')}")

if args.profile:
    from torch.profiler import ProfilerActivity, profile

    for name in ("vitkit default", f"{args.peer} bf16 weights"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            variants[name]()
            variants[name]()
        print(f"\n{name}: two forwards")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
