"""The run's own memory, planned before its first full-size step: on the CPU a step that does not fit is not an
error the run can catch but the kernel's kill (exit 137, no word), and the planner's own timings run full-size
steps. A 50,400-photo folder under a 1.5 GiB container limit was streamed, as it should be, and then killed while
the planner timed the recipe's step at batch 64.

What the step needs is measured on the run's own step at small batches (``runtime.memory.peak_bytes``: PyTorch's
allocations, doubling the batch until the growth per image is steady) and scaled to the batch; the workers that
decode a streamed dataset and a margin are added, and the whole is compared with the memory this process may use
(its container's limit, else the host's). A batch that does not fit is split into micro-batches whose gradients
are accumulated (the recipe's global batch, and so its learning rate, unchanged); a candidate setting that does not
fit at that batch (fp32 where bf16 fits, the exact attention where fused SDPA fits) is not timed; a model that does
not fit at batch 1 is refused, with the numbers, before the kernel does it.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..data.stream import PREFETCH
from ..model.config import ViTConfig
from ..model.naflex import NaFlexBatch
from ..model.vit import VisionTransformer, set_attention
from ..runtime.distributed import rank_and_world
from ..runtime.memory import Memory, available_memory, peak_bytes, release_free_memory
from ..runtime.precision import autocast_for
from ..runtime.threads import usable_cores
from .config import TrainConfig
from .probe import StepProbe

MiB = 2 ** 20
# What the process really holds per byte PyTorch's allocator reports at the step's peak (glibc's arenas and their
# fragmentation, oneDNN's scratch, the trainer's augmentation and gradient clipping beside the step): a ViT-Ti/8
# step at batch 64, 416 MiB of allocations, grew the resident set by 500-520 MiB; a ViT-S/16 at 224 px, batch 8,
# 551 MiB: 620-660 MiB alone and 754 MiB in the trainer (Intel Xeon with AMX, torch 2.14.1, 1 and 2 threads).
OVERHEAD = 1.4
# Python's own objects, the batch in flight and its augmentation, a checkpoint being written, and what the run
# holds beyond the planner's probe (its own model and optimizer, oneDNN's caches): a ViT-Ti/8 run's resident set
# at its first step was ~200 MiB above the planner's at its measurement.
RESERVE = 256 * MiB
# A forked DataLoader worker's own pages: 32-43 MiB private after 30 batches of a streamed folder, and the pages of
# the training process it still shares, which that process copies as it writes them again (the model and optimizer
# state are counted once, ``_state_bytes``; the rest is Python's heap). Two workers of a ViT-Ti/8 run took ~190 MiB
# beside the step, the batches they passed in shared memory (up to 81 MiB) included: ``worker_bytes`` adds those.
WORKER_BYTES = 64 * MiB
# What a measuring step grows the process by, per byte PyTorch allocates in it (its fresh copy of the model, the
# kernels' scratch, the C library's arenas): ViT-S/8 at 384 px, two blocks at batch 4 in bf16 with fused attention,
# 355 MiB allocated, grew the resident set by 686 MiB, and a 1.5 GiB container was killed measuring it.
MEASURING = 2.0
STEADY = 0.15  # the growth per image of two consecutive doublings agrees within this: the activations dominate


@dataclass
class StepMemory:
    """Bytes a setting's training step holds at its peak, as measured at ``batches``: ``peak[i]`` at ``batches[i]``
    (two steps each: the second holds the optimizer's state while it trains)."""

    settings: dict[str, Any]
    batches: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)

    @property
    def per_image(self) -> float:
        if len(self.batches) < 2:
            return self.peak[-1] / self.batches[-1]  # one batch only: all of it counted per image (an upper bound)
        return (self.peak[-1] - self.peak[-2]) / (self.batches[-1] - self.batches[-2])

    def at(self, batch: int) -> int:
        """The peak at ``batch``: measured, scaled from the largest batch measured by the steady growth, or below
        the smallest measured, that one's (the peak never grows as the batch shrinks, and below the smallest batch
        the model and optimizer state set it, not the images)."""
        if batch in self.batches:
            return self.peak[self.batches.index(batch)]
        if batch < self.batches[0]:
            return self.peak[0]
        return int(self.peak[-1] + self.per_image * (batch - self.batches[-1]))


def shallow(probe: StepProbe, depth: int) -> StepProbe:
    """``probe`` with a new model of ``depth`` blocks (the weights do not change what a step holds)."""
    out = copy.copy(probe)
    out.model = VisionTransformer(dataclasses.replace(probe.model.config, depth=depth))
    return out


def step_peak(probe: StepProbe, settings: dict[str, Any], batch: int) -> int:
    """Bytes two training steps of ``probe``'s model at ``batch`` hold at their peak (the second holds the
    optimizer's state while it trains), each on a fresh copy of the model and its optimizer."""
    def two_steps() -> None:
        step = probe.make_fed(settings, augment=False)
        step(probe.x[:batch], probe.target[:batch])
        step(probe.x[:batch], probe.target[:batch])

    try:
        return peak_bytes(two_steps, probe.device)
    finally:  # what the steps freed goes back to the kernel before the next measurement: kept by the C library, it
        release_free_memory()  # grew the process ~100 MiB a measurement (ViT-S/8 at 384 px) until the limit killed it


def measure_step(probe: StepProbe, settings: dict[str, Any], up_to: int, room: float,
                 room_now: Callable[[], float] | None = None) -> StepMemory:
    """The full model's step peak at batch 1, 2, 4, ... until the growth per image is steady, the batch ``up_to``
    is reached, or the next doubling would not fit in ``room`` bytes (``room_now()``: what is left as it measures,
    where that can be read). Each is measured on models of one and two blocks and scaled to the model's depth
    (every block holds the same): no full-size step runs before it is known to fit (a ViT-S/8 at 224 px holds 1.1
    GiB at batch 2, and a 1.5 GiB container was killed measuring it), and no measurement runs that ``MEASURING``
    says would not fit."""
    def fits(allocated: float) -> bool:
        return MEASURING * allocated <= (min(room, room_now()) if room_now else room)

    out = StepMemory(settings)
    depth = probe.model.config.depth
    one, two = shallow(probe, 1), shallow(probe, min(2, depth))
    b = 1  # (from batch 2, one block of ViT-S/8 at 384 px in fp32 with exact attention grew the process by 1 GiB)
    while True:
        try:
            p1 = step_peak(one, settings, b)
            if depth > 1 and not fits(2 * p1):  # two blocks hold at most twice what one does: measured
                # only where that fits (measuring them killed a 1.5 GiB container), else every block counted as
                # that whole step: an upper bound, for a setting that cannot fit
                if not out.batches:
                    out.batches.append(b)
                    out.peak.append(depth * p1)
                return out
            p2 = step_peak(two, settings, b) if depth > 1 else p1
        except (MemoryError, RuntimeError) as e:  # the allocator refused (overcommit limits): not a kill
            if not isinstance(e, MemoryError) and "can't allocate memory" not in str(e):
                raise
            if not out.batches:
                raise ValueError(f"out of memory measuring the training step of a {_size(probe)} model of "
                                 f"one block at batch {b}: {' '.join(str(e).split())[:200]}") from None
            return out

        out.batches.append(b)
        out.peak.append(p1 + (depth - 1) * (p2 - p1))
        steady = len(out.peak) >= 3 and abs(_growth(out, -1) - _growth(out, -2)) <= STEADY * _growth(out, -1)
        nxt = min(2 * b, up_to, len(probe.x))
        if steady or nxt == b or not fits(p2 * nxt / b):  # (what measuring the next batch would hold)
            return out
        b = nxt


def _growth(m: StepMemory, i: int) -> float:
    return (m.peak[i] - m.peak[i - 1]) / (m.batches[i] - m.batches[i - 1])


def measure_eval(probe: StepProbe, settings: dict[str, Any], batch: int = 8) -> float:
    """Bytes per image of an evaluation batch (forward only, no gradients) at ``batch``, everything counted per
    image: an upper bound."""
    model = probe.model.eval()
    set_attention(model, settings["attention"])
    x = probe.x[:batch]
    precision = settings["precision"] if settings["precision"] == "bf16" else "fp32"  # as training evaluates

    def forward() -> None:
        with torch.no_grad(), autocast_for(probe.device, precision):
            model(x)

    try:
        return peak_bytes(forward, probe.device) / len(x)
    finally:
        set_attention(model, "sdpa")
        model.train()


def room_for_this_process(memory: Memory) -> float:
    """What one process may plan on: its share, where torchrun started several on this machine (they share it)."""
    return memory.available / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@dataclass
class MemoryDecision:
    batch: int
    grad_accum: int
    eval_batch: int
    max_workers: int | None  # the most DataLoader workers that fit beside the step (None: not streamed)
    fits: list[dict[str, Any]]  # the candidate settings that fit at ``batch``
    note: str
    measured: list[StepMemory] = field(default_factory=list)


def decide_memory(cfg: TrainConfig, probe: StepProbe, candidates: list[dict[str, Any]], streamed: bool,
                  memory: Memory | None = None) -> MemoryDecision | None:
    """The batch (and accumulation), evaluation batch, workers and candidates that fit the memory this process
    may use; None where that memory cannot be read (not Linux) or the step runs on a GPU (where an allocation
    that does not fit is an error the trainer explains, and ``gpu_batch`` sizes the batch). Raises ValueError
    where not even batch 1 fits.

    The parts: the step at its peak (measured, x ``OVERHEAD``); ``RESERVE``; an EMA of the weights; for a streamed
    dataset the training state the workers share (copied once as it is rewritten) and each worker (``worker_bytes``:
    its pages and its batches in flight). The step gets what is left after one worker; the workers get what is left
    after the step (none: the training process decodes, slower but within the memory)."""
    given = memory
    memory = memory or available_memory()
    if memory is None or probe.device.type != "cpu":
        return None
    room = room_for_this_process(memory)
    state = _state_bytes(probe.model, cfg)  # the model and its optimizer state
    fixed = RESERVE + (_param_bytes(probe.model) if cfg.model_ema else 0) + (state if streamed else 0)
    one_worker = worker_bytes(probe, cfg.batch_size) if streamed else 0
    batch = cfg.batch_size
    worst = _extreme(candidates, worst=True)

    def room_now() -> float:  # as the measurements go (what they leave behind counts); a memory given: fixed
        now = available_memory() if given is None else None
        return room_for_this_process(now) - RESERVE if now is not None else math.inf

    measured = [measure_step(probe, worst, batch, room - fixed - one_worker, room_now)]
    release_free_memory()
    if given is None:  # what the measuring itself left behind (oneDNN's caches, the heap it grew) is gone too
        memory = available_memory() or memory
        room = room_for_this_process(memory)

    def need(m: StepMemory, b: int, copies: int = 1) -> float:
        return step_need(m, b, state, copies)

    space = room - fixed - one_worker  # what the step may hold
    m = measured[0]
    if need(m, batch) > space:  # the setting that takes the most does not fit: the least taking one sets the batch
        best = _extreme(candidates, worst=False)
        if best != worst:
            m = measure_step(probe, best, batch, space, room_now)
            measured.append(m)
    per_eval = measure_eval(probe, m.settings)
    release_free_memory()
    fits_at = _largest_fitting_batch(lambda b: need(m, b), batch, space)
    if fits_at == 0 and streamed:  # no worker: the training process decodes, and shares no pages with one
        fixed, one_worker = fixed - state, 0
        space = room - fixed
        fits_at = _largest_fitting_batch(lambda b: need(m, b), batch, space)
    if fits_at == 0:
        raise ValueError(f"out of memory before the first step: {cfg.init or cfg.model} ({probe.model.num_params:,} "
                         f"parameters) at {_size(probe)} needs ~{(need(m, 1) + fixed + one_worker) / MiB:,.0f} MiB "
                         f"to train even one image a step ({_describe(m)}), and this process may use "
                         f"{memory.describe()}: train a smaller model or --img-size, or give the process more memory")
    accum = cfg.grad_accum * (batch // fits_at)
    # every candidate is timed where all their copies fit beside the step that takes the most; else only the
    # measured one that fits (four copies of ViT-S/16 and their AdamW state took 1.2 GiB while a 1.25 GiB container's
    # planner timed them, where the run's own step at batch 2 needed under 0.5)
    together = need(measured[0], fits_at, len(candidates)) <= space
    fits = candidates if together else [c for c in candidates if _key(c) == m.settings]
    step = need(m, fits_at)
    eval_batch = max(1, min(cfg.eval_batch_size, int((room - fixed - one_worker - need(m, 1))  # the state stays
                                                     / max(OVERHEAD * per_eval, 1.0))))
    workers = None
    if streamed and one_worker == 0:
        workers = 0
    elif streamed:  # the evaluation's batches in flight are the larger: as many workers as fit at it
        workers = max(0, int((room - fixed - step) // worker_bytes(probe, max(fits_at, eval_batch))))
        while workers == 0 and eval_batch > fits_at:  # a smaller evaluation batch before no worker at all
            eval_batch = max(fits_at, eval_batch // 2)
            workers = max(0, int((room - fixed - step) // worker_bytes(probe, eval_batch)))
    note = (f"memory: {memory.describe()}; the step needs ~{need(m, batch) / MiB:,.0f} MiB at batch {batch} "
            f"({_describe(m)}), {(fixed + one_worker) / MiB:,.0f} MiB more for Python"
            + (", the EMA" if cfg.model_ema else "") + (", a DataLoader worker" if one_worker else "") + ": ")
    if fits_at == batch:
        note += f"batch {batch} fits"
    else:
        note += (f"batch {batch} does not fit: {fits_at} a step, {accum} accumulated (the global batch and the LR "
                 f"unchanged)")
    dropped = [c for c in candidates if c not in fits]
    if dropped:
        why = ("too large at that batch" if need(measured[0], fits_at) > space else
               f"{len(candidates)} copies of the model and its optimizer state, timed side by side, would not fit")
        note += f"; not timed, {why}: " + ", ".join(f"{c['precision']} {c['attention']}" for c in dropped)
    if eval_batch < cfg.eval_batch_size:
        note += f"; evaluation batch {cfg.eval_batch_size} -> {eval_batch}"
    if workers == 0:
        note += "; no room for a DataLoader worker: the training process decodes the images itself"
    elif workers is not None and workers < 2 * usable_cores():  # (beyond that, the cores cap them: plan.py)
        note += f"; room for {workers} DataLoader worker{'s' if workers != 1 else ''}"
    return MemoryDecision(fits_at, accum, eval_batch, workers, fits or candidates[:1], note, measured)


def step_need(m: StepMemory, batch: int, state: int, copies: int = 1) -> float:
    """Bytes a step at ``batch`` holds, ``copies`` models with their optimizer states (``state`` bytes each) built
    side by side, as the planner times its candidates round-robin: the states as they are (large tensors, allocated
    once), the rest of the measured peak (activations, gradients, the kernels' buffers) x ``OVERHEAD``. With all of
    it x OVERHEAD, ViT-S/16 at 224 px was refused in a 1.25 GiB container at one image a step, and trained in it at
    two."""
    return copies * state + OVERHEAD * max(0, m.at(batch) - state)


def worker_bytes(probe: StepProbe, batch: int) -> int:
    """One DataLoader worker: its own pages and its batches in flight, ``PREFETCH`` of them at ``batch``, each held
    three times (collated in the worker, in shared memory, and the training process's copy): an evaluation worker
    at batch 238 grew to 119 MiB."""
    return _worker_bytes(_image_bytes(probe.x), batch)


def _worker_bytes(image_bytes: int, batch: int) -> int:
    return WORKER_BYTES + 3 * PREFETCH * batch * image_bytes


def gpu_host_workers(image_bytes: int, batch: int, memory: Memory | None = None
                     ) -> tuple[int, int, Memory] | None:
    """On a GPU host, the most DataLoader workers a streamed run's host memory holds, what one holds, and that
    memory (None where it cannot be read). There the step's memory is the GPU's, so ``decide_memory`` plans nothing,
    and the worker count was capped by the cores alone (issue 80, P9): 32 workers of ImageNet photos at batch 4096
    hold ~7 GiB each of batches in flight (``worker_bytes``), 222 GiB, more than many hosts have. The training
    process had started CUDA and built its model when this is asked: what it holds is already out of ``memory``;
    ``RESERVE`` stays for it."""
    memory = memory or available_memory()
    if memory is None:
        return None
    per = _worker_bytes(image_bytes, batch)
    return max(0, int((room_for_this_process(memory) - RESERVE) // per)), per, memory


def _image_bytes(x: Any) -> int:
    """One image of the batch ``x`` as decoded (uint8): (C, H, W) pixels, or a NaFlex image's patches and their
    coordinates and mask."""
    if isinstance(x, NaFlexBatch):
        _, length, dim = x.patches.shape
        return length * (dim + 2 * x.coords.element_size() + 1)
    return int(math.prod(x.shape[1:]))


def check_weights_fit(cfg: TrainConfig, config: ViTConfig, memory: Memory | None = None) -> None:
    """Before the model is built at all: its weights, the planner's copy of them, their gradients and the
    optimizer's state must fit (a model built on PyTorch's meta device is counted, nothing allocated). A ViT-L
    under a 1.5 GiB limit was killed while the planner built its copy. Raises ValueError naming the sizes."""
    memory = memory or available_memory()
    if memory is None:
        return
    params = count_params(config)
    _, world = rank_and_world()
    shards = world if world > 1 and cfg.shard is not False else 1  # (--shard auto shards what would not fit whole)
    # fp32: the model and the probe's copy whole, the gradients and moments (a sharded run's: its share)
    need = params * 4 * (2 + (1 + optimizer_moments(cfg)) / shards) + RESERVE
    if need > room_for_this_process(memory):
        raise ValueError(f"out of memory before the first step: {cfg.model} ({params:,} parameters) needs at least "
                         f"{need / MiB:,.0f} MiB for its weights, a copy the planner times, the gradients and the "
                         f"{cfg.opt} optimizer's state, before any image, and this process may use "
                         f"{memory.describe()}: train a smaller model, or give the process more memory")


def count_params(config: ViTConfig) -> int:
    """The parameters of a ViT of ``config``, counted on PyTorch's meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in VisionTransformer(config).parameters())


def _largest_fitting_batch(need: Callable[[int], float], batch: int, space: float) -> int:
    """The largest divisor of ``batch`` (so that micro-batches add up to it) whose step's ``need`` fits in
    ``space``; 0 if none."""
    for b in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
        if need(b) <= space:
            return b
    return 0


def _key(c: dict[str, Any]) -> dict[str, Any]:
    return {"precision": c["precision"], "attention": c["attention"], "channels_last": False}


def _extreme(candidates: list[dict[str, Any]], worst: bool) -> dict[str, Any]:
    """The candidate that takes the most memory (fp32 over bf16, the exact attention over fused SDPA, which keeps
    no attention matrix), or the least; the memory layout moves one convolution and is not told apart."""
    order = {"fp32": 2, "tf32": 2, "fp16": 1, "bf16": 0, "exact": 1, "sdpa": 0}
    pick = max if worst else min
    return _key(pick(candidates, key=lambda c: (order.get(c["precision"], 2), order.get(c["attention"], 1))))


def _describe(m: StepMemory) -> str:
    at = f"batch {m.batches[0]}" + (f"-{m.batches[-1]}" if len(m.batches) > 1 else "")
    return f"{m.settings['precision']} {m.settings['attention']}, measured at {at}"


def _size(probe: StepProbe) -> str:
    if isinstance(probe.x, NaFlexBatch):
        return f"{probe.x.patches.shape[1]} patches an image"
    h, w = probe.x.shape[-2:]
    return f"{h}x{w}"


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _state_bytes(model: torch.nn.Module, cfg: TrainConfig) -> int:
    """The model and its optimizer's state (AdamW: two moments; SGD: the momentum; Muon: its momentum)."""
    return _param_bytes(model) * (1 + optimizer_moments(cfg))


def optimizer_moments(cfg: TrainConfig) -> int:
    return 2 if cfg.opt == "adamw" else 1
