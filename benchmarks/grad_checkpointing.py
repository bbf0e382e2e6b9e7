"""Activation checkpointing (``--grad-checkpointing``): the training step's memory and time with and without it, for
one model and batch. Memory: the most the step holds at once beyond the model (PyTorch's CPU allocator as the
profiler reports it; a GPU's caching allocator's peak). Time: the median of ``--repeats`` steps each, round-robin in
one process (forward, backward, AdamW step).

    python benchmarks/grad_checkpointing.py [--model vit_small_patch16_224] [--batch 16] [--csv results/grad-checkpointing.csv]

Not a test: numbers, no assertions.
"""
import argparse
import statistics
import time

import torch

import vitkit
from _helpers import append_csv_rows, cpu_label, csv_arg
from vitkit.model.config import to_2tuple
from vitkit.runtime.memory import peak_bytes

p = argparse.ArgumentParser()
p.add_argument("--model", default="vit_small_patch16_224")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--device", default="cpu")
p.add_argument("--csv", type=csv_arg, help="append the rows to this CSV (with the CPU kind and this command)")
args = p.parse_args()
device = torch.device(args.device)

torch.manual_seed(0)
model = vitkit.create_model(args.model, num_classes=10).to(device).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
size = to_2tuple(model.config.img_size)
x = torch.randn(args.batch, model.config.in_chans, *size, device=device)
y = torch.randint(0, 10, (args.batch,), device=device)


def step() -> None:
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


memory, times = {}, {False: [], True: []}
for on in (False, True):
    model.set_grad_checkpointing(on)
    step()  # warm-up: the optimizer's state made, kernels chosen
    memory[on] = peak_bytes(step, device)
for r in range(args.repeats):
    for on in ((False, True) if r % 2 == 0 else (True, False)):
        model.set_grad_checkpointing(on)
        t = time.perf_counter()
        step()
        times[on].append(time.perf_counter() - t)
rows = []
for on in (False, True):
    s = statistics.median(times[on])
    rows.append({"model": args.model, "batch": args.batch, "grad_checkpointing": on,
                 "step_memory_mib": round(memory[on] / 2**20), "step_s": round(s, 3),
                 "machine": cpu_label() if device.type == "cpu" else torch.cuda.get_device_name(device)})
    print(f"{args.model} batch {args.batch} checkpointing {str(on):5}: {memory[on] / 2**20:7.0f} MiB, {s:.3f} s a step")
print(f"checkpointed: {memory[True] / memory[False]:.2f}x the memory, {statistics.median(times[True]) / statistics.median(times[False]):.2f}x the time")
if args.csv:
    append_csv_rows(args.csv, rows)
