"""What an explanation costs against the pass it explains: one image through ViT-B/16 at 224x224, each method of
``vitkit.inspect.explain`` against one forward + backward pass of the same model (the target logit's gradient
with respect to the parameters), timed round-robin in one process; the ratio is taken within each round.

    python benchmarks/explain_speed.py [--model vit_base_patch16_224] [--rounds 5] [--dtype fp32]

Not a test: numbers, no assertions. Run nothing else on the machine meanwhile.
"""
import argparse
import statistics

import torch

import vitkit
from vitkit.bench.timing import round_robin_times
from vitkit.inspect.explanations import METHODS, explain
from vitkit.model.config import to_2tuple
from vitkit.runtime.cpu import machine_name

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--rounds", type=int, default=5, help="timed rounds; each runs every variant once")
p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()
if args.rounds < 1:
    p.error("--rounds must be at least 1")

torch.manual_seed(0)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
model = vitkit.create_model(args.model).eval().to(args.device, dtype)
with torch.no_grad():
    model.head.weight.normal_(0, 0.02)
x = torch.randn(1, 3, *to_2tuple(model.config.img_size), device=args.device, dtype=dtype)


def forward_backward() -> None:
    model.zero_grad(set_to_none=True)
    model(x)[0, 1].backward()


fns = [forward_backward] + [lambda m=m: explain(model, x, 1, m) for m in METHODS]
times = round_robin_times(fns, warmup=1, repeats=args.rounds, device=args.device)
machine = machine_name(torch.device(args.device))
print(f"{args.model}, one {tuple(x.shape[-2:])} image, {args.dtype}, {args.device}: {machine}, "
      f"{torch.get_num_threads()} threads, {args.rounds} rounds")
print(f"{'forward + backward':<20}{statistics.median(times[0]) * 1000:9.1f} ms")
for name, ts in zip(METHODS, times[1:]):
    ratios = [t / base for t, base in zip(ts, times[0])]
    print(f"{name:<20}{statistics.median(ts) * 1000:9.1f} ms  {statistics.median(ratios):5.2f}x "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
