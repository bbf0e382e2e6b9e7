"""torch.distributed for ``torchrun``: the process group from its environment, and tearing it down safely."""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .device import resolve_device


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def launched_distributed() -> bool:
    """Whether torchrun started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def restart_count() -> int:
    """How many times torchrun has restarted the group after a failure (0 on the first start): the group's round
    once ``init_distributed`` has counted it (``group_round``), this node's agent's count before."""
    return _RESTARTS if _RESTARTS is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_RESTARTS: int | None = None


def local_rank() -> int:
    """This process's index among torchrun's processes on this machine (0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def distributed_device(device: str = "auto") -> torch.device:
    """The device this rank trains on: ``cuda:<local rank>`` where CUDA is used (``auto`` with a GPU, or ``cuda``),
    else the CPU (gloo). More ranks on this machine than GPUs is refused before any process group exists: NCCL
    fails with "invalid usage" when two ranks share a GPU."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if not check_ranks_fit(per_node, device):
        return torch.device("cpu" if device == "auto" else device)
    named = torch.device(device) if device != "auto" else None
    if named is not None and named.index is not None and per_node > 1:  # every rank would train on that one GPU
        raise ValueError(f"--device {device} with {per_node} processes on this machine: each process trains on its "
                         "own GPU, cuda:<its local rank>. Give --device cuda, and choose the GPUs with "
                         f"CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES={named.index},... torchrun ...)")
    return torch.device("cuda", local_rank())


def check_ranks_fit(per_node: int, device: str = "auto") -> bool:
    """Whether ``per_node`` processes on this machine train on CUDA with ``device``; a ValueError naming what works
    where they would not fit (more processes than GPUs), or where ``device`` is not here."""
    if device != "auto":
        resolve_device(device)  # a device this machine lacks: one line naming what works
    if not (device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())):
        return False
    gpus = torch.cuda.device_count()
    if per_node > gpus:
        raise ValueError(f"{per_node} processes on this machine but it has {gpus} GPU"
                         f"{'' if gpus == 1 else 's'}: one process per GPU. Run with --nproc-per-node {max(gpus, 1)} "
                         "(at most the GPU count), or add --device cpu to train on CPU processes (gloo)")
    return True


def launch(nproc: int, argv: list[str], device: str = "auto") -> int:
    """``vitkit train --nproc-per-node N``: start N processes of ``python -m vitkit ARGV`` on this machine, as
    ``torchrun --standalone`` does (torch.distributed's elastic launcher, a free port on loopback), after checking
    that they fit; returns the first failed process's exit code (0 when all succeed). Each process says its own
    error in one line, so the launcher's report of the failure (a Python traceback) is not printed."""
    # torch's elastic launcher, imported only by the command that starts processes (start-up time)
    from torch.distributed.elastic.multiprocessing.api import SignalException  # start-up time
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # start-up time
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # start-up time

    check_ranks_fit(nproc, device)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"vitkit-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0)
    quiet = logging.getLogger("torch.distributed.elastic")
    level, quiet.level = quiet.level, logging.CRITICAL  # its INFO/WARNING/ERROR lines: the processes speak
    try:
        elastic_launch(config, sys.executable)("-m", "vitkit", *argv)
    except SignalException as e:  # Ctrl-C or SIGTERM: the processes got it too, and say what they do about it
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the others were stopped because of it
        code = first.exitcode or 1
        if code < 0:  # killed by a signal: the process could not say why itself (the run exited 247 silently)
            sig = -code
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            print(f"vitkit train: process {rank} of {nproc} was killed by {name}"
                  + (" (out of memory? the kernel's killer sends it)" if sig == signal.SIGKILL else "")
                  + "; the others were stopped. The last checkpoint is the run folder's last/ (--resume auto "
                  "continues from it)", file=sys.stderr)
        return 128 - code if code < 0 else code  # a signal's exit status, as a shell reports it (137: SIGKILL)
    finally:
        quiet.level = level
    return 0


def init_distributed(device: str = "auto") -> torch.device:
    """The process group from torchrun's environment (nccl on this rank's GPU, gloo on CPU); returns the rank's
    device. Keys are prefixed with the group's round (``group_round``): after torchrun restarts a failed group, the
    new ranks must not read the dead ranks' addresses."""
    dev = distributed_device(device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store, timeout=timedelta(minutes=5))
    kw = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        kw["device_id"] = dev  # NCCL binds this rank to its GPU instead of guessing
    global _RESTARTS
    round_, _RESTARTS = group_round(store, world, agent_store)
    prefixed = dist.PrefixStore(f"vitkit/round{round_}-of-{world}", store)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=prefixed, rank=rank, world_size=world,
                            **kw)
    global _STORE
    _STORE = dist.PrefixStore("ready", prefixed)
    return dev


def group_round(store: "dist.Store", world: int, agent_store: bool) -> tuple[int, int]:
    """(which start of a group of this size this is, how many starts came before it): the same on every rank. Not
    torchrun's restart count: each node's agent keeps its own, and one whose worker was still running when another
    node rejoined restarts it without counting ("membership changes do not count as retries"), so two nodes started
    one group with counts 1 and 0 and their ranks waited for each other under different keys (a CI run hung 300 s
    in the loopback two-node test). The agents' store outlives the groups: each worker counts its arrival there
    once, ``world`` arrivals a round, also by world size (torchrun's ``--nnodes MIN:MAX`` may start rounds of other
    sizes). A worker that died before it arrived leaves its round short; the ranks of the next then disagree whether
    it is a restart, and stop saying so (cli/train.py). Without the agents' store (a store of each round's own), the
    restart count."""
    if not agent_store:
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return count, count
    of_size = int(store.add(f"vitkit/arrivals-of-{world}", 1))
    before = int(store.add("vitkit/arrivals", 1))
    return (of_size - 1) // world, (before - 1) // world


_STORE: "dist.Store | None" = None  # the group's key-value store, for waits longer than a collective's timeout
RANK0_WAIT = timedelta(hours=12)  # how long the other ranks wait for rank 0 to read the data and plan: an
# ImageNet-sized folder's first listing and decode is far longer than NCCL's 10-minute collective timeout


def wait_for_rank0(what: str) -> None:
    """Ranks other than 0 wait here until rank 0 calls ``rank0_done(what)``, up to ``RANK0_WAIT`` (a barrier would
    be a collective, killed by NCCL's watchdog after 10 minutes while rank 0 still decodes). A RuntimeError where
    rank 0 stopped first (its store is gone: it said why)."""
    if _STORE is None:
        dist.barrier()
        return
    try:
        _STORE.wait([_key(what)], RANK0_WAIT)
    except Exception as e:  # noqa: BLE001 - the store's errors: timeout, connection closed
        raise RuntimeError(f"rank 0 did not finish {what}: {e}") from None


def rank0_done(what: str) -> None:
    """Rank 0 releases the ranks waiting in ``wait_for_rank0(what)``."""
    if _STORE is None:
        dist.barrier()
        return
    _STORE.set(_key(what), "1")


_WAITED: dict[str, int] = {}


def _key(what: str) -> str:
    """``what`` numbered by how many times this process has waited for it (every rank counts alike): a second plan
    in the same group waits for its own release, not the first one's."""
    _WAITED[what] = _WAITED.get(what, 0) + 1
    return f"{what}-{_WAITED[what]}"


def destroy_process_group() -> None:
    """Tear the group down once nothing holds it: the DDP wrapper keeps the gloo process group alive, and a group
    freed during interpreter shutdown instead aborts the process now and then (SIGABRT "terminate called without an
    active exception", or SIGBUS, after the run has finished)."""
    gc.collect()  # the trainer's reference cycles (closures over it) go now, not at exit
    dist.destroy_process_group()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any (a stop request or a NaN must stop all ranks together)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_ints(values: list[int], device: torch.device) -> list[int]:
    """Rank 0's ``values`` on every rank (one plan for all: ranks time themselves differently)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, device=device)
    dist.broadcast(t, src=0)
    return [int(v) for v in t]


@contextmanager
def gradients_reduced(model: torch.nn.Module, now: bool) -> Iterator[None]:
    """The forward and backward inside all-reduce DDP's gradients across ranks only if ``now`` (the last micro-batch
    of a ``--grad-accum`` step); the others add to each rank's own gradients, reduced once with the last (DDP's
    ``no_sync``). Without it each micro-batch all-reduced its gradients: grad_accum times the step's traffic for the
    same sum. A sharded model (FSDP2) still reduce-scatters each micro-batch: skipping it
    (``set_requires_gradient_sync(False)``) would hold every rank's gradients whole between micro-batches, the
    4 B a parameter that sharding saves and the memory plan counts as 1/world."""
    inner = getattr(model, "_orig_mod", model)  # (a compiled wrapper's own module)
    if now or not isinstance(inner, DistributedDataParallel):
        yield
    else:
        with inner.no_sync():
            yield


def barrier() -> None:
    """Every rank waits for the others here (nothing outside a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank, rank 0's first (``[obj]`` outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
