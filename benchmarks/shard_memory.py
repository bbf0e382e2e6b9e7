"""``--shard`` (FSDP2) against DDP: what each process holds and how long a step takes, for one model and batch, on
N processes started here with torchrun (gloo on the CPU; NCCL where --device cuda).

Held: the bytes of the weights, gradients and AdamW state a process keeps between steps (its local tensors,
counted exactly), and the process's resident memory after the steps, its freed heap given back (on a GPU: the
caching allocator's peak). Time:
the median step (forward, backward, the gradients' reduction, AdamW), the processes in step. The two modes run one
after the other, each in its own processes (a process group holds one mode).

    python benchmarks/shard_memory.py [--model vit_base_patch16_224] [--img 32] [--batch 8] [--nproc 2]
                                      [--csv results/shard-memory.csv]

Not a test: numbers, no assertions.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--img", type=int, default=32, help="image side (patch 4: a CPU runs ViT-B's width and depth)")
p.add_argument("--batch", type=int, default=8, help="images a process a step")
p.add_argument("--nproc", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--device", default="cpu")
p.add_argument("--csv", help="append the rows to this CSV (with the CPU kind and this command)")
p.add_argument("--mode", help=argparse.SUPPRESS)  # (set for the processes torchrun starts)
args = p.parse_args()


def worker() -> None:
    import resource

    import torch.distributed as dist

    import vitkit
    from vitkit.runtime.memory import release_free_memory
    from vitkit.training.config import TrainConfig
    from vitkit.training.optim import build_optimizer
    from vitkit.training.shard import shard_module

    rank = int(os.environ["RANK"])
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{os.environ['LOCAL_RANK']}")
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    torch.manual_seed(0)
    model = vitkit.create_model(args.model, num_classes=10, img_size=args.img, patch_size=4).to(device).train()
    if args.mode == "shard":
        shard_module(model, device)
        train = model
    else:
        train = torch.nn.parallel.DistributedDataParallel(model)
    opt = build_optimizer(model, TrainConfig(dataset="digits"))
    x = torch.randn(args.batch, 3, args.img, args.img, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    times = []
    for i in range(args.steps + 1):  # (the first: the optimizer's state made; not timed)
        dist.barrier()
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(train(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # (the gradients counted as held, as a step keeps them until the next)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    held = sum(local(q).numel() * q.element_size() for q in model.parameters())
    held += sum(local(q.grad).numel() * q.element_size() for q in model.parameters() if q.grad is not None)
    held += sum(local(v).numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    release_free_memory()  # (glibc keeps freed heap: the whole model each process built before it was sharded)
    resident = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                else int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    out = {"rank": rank, "held": held, "resident": resident, "step_s": statistics.median(times),
           "params": sum(q.numel() for q in model.parameters()),
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print("ROW " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if args.mode:
    worker()
    sys.exit(0)

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import append_csv_rows, cpu_label  # noqa: E402

rows = []
for mode in ("ddp", "shard"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, *sys.argv[1:], "--mode", mode]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    got = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW ")]
    if r.returncode or len(got) != args.nproc:
        sys.exit(f"{mode}: exit {r.returncode}\n{r.stderr[-3000:]}")
    worst = max(got, key=lambda g: g["held"])
    rows.append({"model": args.model, "img": args.img, "params": worst["params"], "processes": args.nproc,
                 "batch_per_process": args.batch, "mode": mode,
                 "held_mib": round(worst["held"] / 2**20, 1),
                 "resident_mib": round(max(g["resident"] for g in got) / 2**20, 1),
                 "step_s": round(statistics.median(g["step_s"] for g in got), 3)})
    print(rows[-1], flush=True)
if args.csv:
    machine = cpu_label() if args.device == "cpu" else torch.cuda.get_device_name(0)
    append_csv_rows(args.csv, [{**r, "machine": machine,
                                "command": "python benchmarks/shard_memory.py " + " ".join(sys.argv[1:])}
                               for r in rows])
