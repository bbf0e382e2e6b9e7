"""Is `auto` the fastest? Every candidate the planner times, timed again by hand for much longer (round-robin, in
this process), against what the planner chose: the training step of a recipe's model, and the inference dtype of
``optimize_for_inference`` for a preset. Prints a table per workload and the chosen one's ratio to the fastest.

    python benchmarks/plan_check.py [--dataset fashion-mnist] [--time-limit 5] [--steps 20] [--rounds 5]
                                    [--infer vit_base_patch16_224 vit_small_patch16_224] [--batch 16]

Not a test: numbers, no assertions. Run nothing else on the machine meanwhile.
"""
import argparse
import statistics
import time

import torch

import vitkit
from vitkit.model.vit import set_attention
from vitkit.runtime.cpu import machine_name
from vitkit.runtime.inference import inference_candidates
from vitkit.runtime.precision import DTYPES
from vitkit.training.build import build_data
from vitkit.training.plan import Sources, StepProbe, _probe, make_plan, resolve, step_candidates

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--dataset", default="fashion-mnist")
p.add_argument("--time-limit", type=float, default=5.0, help="the budget whose tier's model is checked")
p.add_argument("--steps", type=int, default=20, help="training steps per timed call")
p.add_argument("--rounds", type=int, default=5, help="timed calls of each candidate, round-robin (median counts)")
p.add_argument("--infer", nargs="*", default=["vit_base_patch16_224", "vit_small_patch16_224"])
p.add_argument("--batch", type=int, default=16, help="inference batch")
args = p.parse_args()
if min(args.rounds, args.steps, args.batch) < 1:
    p.error("--rounds, --steps and --batch must be at least 1")
CPU = torch.device("cpu")


def by_hand(makers: dict[str, callable], calls: int) -> dict[str, float]:
    """Median seconds of ``calls`` calls of each maker's function, round-robin after one warm-up call each."""
    fns = {k: m() for k, m in makers.items()}
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def report(what: str, chosen: str, timed: dict[str, float]) -> None:
    best = min(timed.values())
    print(f"\n{what} ({machine_name(CPU)}, {torch.get_num_threads()} threads)")
    for k, v in sorted(timed.items(), key=lambda kv: kv[1]):
        print(f"  {k:<40} {v * 1e3:8.2f} ms  {v / best:5.2f}x{'  <- auto' if k == chosen else ''}")
    print(f"  auto is {timed[chosen] / best:.3f}x the fastest timed by hand")


# the training step: the planner's choice for the recipe at this budget, then every candidate by hand
cfg, data, recipe = resolve(Sources({"dataset": args.dataset, "time_limit": args.time_limit}), lambda s: None)
data = data or build_data(cfg)
planned, plan = make_plan(cfg, data, recipe, log=lambda s: None, refresh=True)
torch.set_num_threads(plan.chosen["threads"])
probe: StepProbe = _probe(planned, data, CPU)
cands = step_candidates(cfg, CPU, bool(probe.model.config.hybrid))


def key(s: dict) -> str:
    return f"{s['precision']} {s['attention']} channels_last={s['channels_last']}"


timed = by_hand({key(s): (lambda s=s: probe.make(s)) for s in cands}, args.steps)
report(f"training step, {args.dataset} --time-limit {args.time_limit:g} (the tier's model, batch {probe.n})",
       key({k: planned.to_dict()[k] for k in ("precision", "attention", "channels_last")}), timed)

# inference: optimize_for_inference's default against every dtype it could have chosen
for model_name in args.infer:
    model = vitkit.create_model(model_name).eval()
    auto = vitkit.optimize_for_inference(model, batch_size=args.batch)
    x = torch.randn(args.batch, 3, 224, 224)
    makers = {}
    for c in inference_candidates(CPU):
        fast = vitkit.optimize_for_inference(model, dtype=None if c["dtype"] == "fp32" else DTYPES[c["dtype"]])
        set_attention(fast.model, c["attention"])
        makers[f"{c['dtype']} {c['attention']}"] = lambda fast=fast: (lambda: fast(x))
    chosen = f"{auto.precision} {auto.model.blocks[0].attn.impl}"
    report(f"inference, {model_name} batch {args.batch}", chosen, by_hand(makers, 1))
