"""``--shard``: FSDP2 (``torch.distributed.fsdp.fully_shard``), each process holding 1/world of the weights,
their gradients and the optimizer's state instead of a whole replica (DDP).

Each encoder layer (``Block``, and MAE's decoder layers) is a unit of its own, the rest of the model (patch and
position embedding, the final norm, the head, an objective's parts) the root's: a layer's weights are gathered
just before its forward and backward and freed after, so a process holds about one layer whole at a time. The
gradients are averaged over the processes as DDP averages them (reduce-scatter), so a sharded run takes the same
steps as a DDP one, to rounding.

Checkpoints: ``last/`` keeps the weights whole in ``model.safetensors`` (gathered to rank 0, as every command
reads a checkpoint on one process), and the training state's weights and optimizer state as
``torch.distributed.checkpoint`` writes them, one file a process, in ``last/shards/``; DCP reshards as it reads,
so a run resumes with another number of processes, sharded or not.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.vit import Block
from ..runtime.memory import available_memory
from .config import TrainConfig
from .memory_plan import optimizer_moments

SHARDS = "shards"  # the folder of a sharded checkpoint's DCP files, inside last/ (and diverged/)
# --shard auto shards where a replica (weights, gradients, optimizer moments, in fp32) would take more than this
# share of what a process may use: the rest is the activations' and the data's
REPLICA_SHARE = 0.5
KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")  # an optimizer group's how, not its what


def replica_bytes(params: int, cfg: TrainConfig) -> int:
    """A DDP replica's fp32 weights, gradients and the optimizer's moments (AdamW two, SGD and Muon one)."""
    return params * 4 * (2 + optimizer_moments(cfg))


def room_per_process(device: torch.device) -> tuple[int | None, str]:
    """Bytes one process may use: the GPU's free memory, or this host's (its cgroup's) shared by the processes on
    it; None where it cannot be read."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on {device}"
    memory = available_memory()
    if memory is None:
        return None, "unknown"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return memory.available // per_node, memory.describe() + (f" for {per_node} processes" if per_node > 1 else "")


def what_stops_sharding(cfg: TrainConfig) -> str:
    """Why this run cannot be sharded ("" when it can)."""
    if cfg.model_ema:
        return "--model-ema keeps a whole copy of the weights on every process"
    if cfg.opt == "muon":
        return "Muon orthogonalises each weight matrix whole, and a process holds only rows of it"
    if cfg.precision == "fp16":  # (torch's GradScaler finds an inf in the shards a process holds, and skips or
        # takes the step by that alone: processes that disagree would step apart)
        return "fp16's loss scaler would decide on each process's shards alone (--precision bf16 or fp32)"
    if cfg.compile:
        return "torch.compile of a sharded model is not tried by vitkit (--compile false)"
    return ""


def decide_shard(cfg: TrainConfig, params: int, device: torch.device, world: int,
                 compile_asked: Any = None) -> tuple[TrainConfig, str]:
    """``cfg`` with ``shard`` true or false, and the plan's line about it ("" when there is nothing to say).
    ``compile_asked``: the run's --compile before the planner decided it (an ``auto`` compile gives way)."""
    asked = cfg.shard
    if world == 1:
        note = "shard: off (one process holds the whole model: nothing to shard across)" if asked is True else ""
        return replace(cfg, shard=False), note
    if asked is True and cfg.compile and compile_asked == "auto":  # compile decided by the planner: shard wins
        cfg = replace(cfg, compile=False)
    why = what_stops_sharding(cfg)
    if asked is True:
        if why:
            raise ValueError(f"--shard: {why}; shard without it, or train with DDP (--no-shard)")
        return cfg, f"shard: on, fully_shard per block across {world} processes (asked)"
    if asked is False:
        return cfg, ""
    need = replica_bytes(params, cfg)
    room, where = room_per_process(device)
    if room is None or need <= REPLICA_SHARE * room:
        return replace(cfg, shard=False), ""
    said = (f"a replica ({params:,} parameters: weights, gradients and {cfg.opt}'s state) takes "
            f"{need / 2**30:.2f} GiB, over {REPLICA_SHARE:.0%} of the {where}")
    if why:
        return replace(cfg, shard=False), f"shard: off, though {said}: {why}"
    if cfg.compile and compile_asked == "auto":
        cfg = replace(cfg, compile=False)
        said += " (compile: off, as vitkit does not compile a sharded model)"
    return replace(cfg, shard=True), f"shard: on, fully_shard per block across {world} processes: {said}"


def shard_module(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` sharded in place, each encoder (and decoder) layer a unit, the rest the root's; returns an
    unsharded copy of it on the meta device (no memory), which ``whole_copy`` fills to save a checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh  # start-up time
    from torch.distributed.fsdp import fully_shard  # start-up time

    with torch.no_grad():  # every process starts from rank 0's weights, as DDP's wrap makes them (each process
        for t in module.state_dict().values():  # drew its own at its seed; its shard would be cut from those)
            dist.broadcast(t, src=0)
    twin = copy.deepcopy(module).to("meta")
    # MAE's forward returns its prediction as a slice (a view) beside the loss; FSDP warns that an in-place edit
    # of a view would skip its pre-backward hook. The backward starts from the loss, and nothing edits the
    # prediction in place (the figure reads it): the warning, on every process every step, is not the run's
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in [m for m in module.modules() if isinstance(m, Block)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return twin


def whole_copy(module: nn.Module, twin: nn.Module) -> nn.Module | None:
    """On rank 0, ``twin`` holding the sharded ``module``'s whole weights on the CPU (None on the others); a
    collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # start-up time

    whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not whole:  # (cpu_offload: rank 0 alone receives the whole weights)
        return None
    twin.load_state_dict(whole, strict=False, assign=True)
    return twin


def save_shards(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The weights and the optimizer's state, each process writing its own shards into ``path`` (a collective)."""
    import torch.distributed.checkpoint as dcp  # start-up time
    from torch.distributed.checkpoint.api import CheckpointException  # start-up time
    from torch.distributed.checkpoint.state_dict import get_state_dict  # start-up time

    weights, state = get_state_dict(module, optimizer)
    try:
        dcp.save({"model": weights, "optimizer": state}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except CheckpointException as e:  # (a BaseException: as an OSError, checkpoint.write_new says what to do)
        raise OSError(_why(e)) from None


def load_shards(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """What ``save_shards`` wrote, into ``module`` and ``optimizer`` as they are now: sharded across this many
    processes, across another number, or whole (DCP reads each tensor into the layout asked)."""
    import torch.distributed.checkpoint as dcp  # start-up time
    from torch.distributed.checkpoint.api import CheckpointException  # start-up time
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # start-up time

    weights, state = get_state_dict(module, optimizer)
    both = {"model": weights, "optimizer": state}
    try:
        with warnings.catch_warnings():  # (one process: a sharded run resumed without torchrun, as DCP says)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(both, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException (a BaseException,
        # not an Exception) wraps each rank's error: a truncated shard file was a traceback
        raise ValueError(f"{path}: could not read the sharded training state ({_why(e)}); the whole weights are "
                         f"in {path.parent / 'model.safetensors'} (--init starts a new run from them)") from None
    with own_kernels(optimizer):
        set_state_dict(module, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])


def _why(e: BaseException) -> str:
    """DCP's error in a line: each failed rank's own exception (its text is a traceback per rank)."""
    failures = {r: x[0] if isinstance(x, tuple) else x  # (each: the exception and its frames)
                for r, x in (getattr(e, "failures", None) or {}).items()}
    said = "; ".join(f"rank {r}: {type(x).__name__}{': ' + str(x) if str(x) else ''}" for r, x in failures.items())
    return " ".join((said or str(e)).split())[:200]


@contextlib.contextmanager
def own_kernels(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading an optimizer's state loads its groups' settings too, the kernel choice among them: a DDP run's fused
    SGD state made a sharded run's SGD fused, which torch cannot run on DTensors. The kernels stay this run's."""
    kernels = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    try:
        yield
    finally:
        for g, own in zip(optimizer.param_groups, kernels):
            g.update(own)


def load_whole(module: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, Any],
               state: dict[str, Any]) -> None:
    """A whole training state (a DDP or one-process run's ``train_state.pt``) into a sharded ``module`` and its
    ``optimizer``. The optimizer's state is numbered as ``Optimizer.state_dict`` numbers it (the parameters of
    its groups in order), and the optimizer was built alike from the same model: the numbers are named here by the
    parameters they stand for, which is what the sharded loader takes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # start-up time

    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError(f"the saved optimizer state has {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters and this run's optimizer {len(order)}: not the same model and optimizer")
    named = {"state": {order[i]: v for i, v in state["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    with own_kernels(optimizer):
        set_state_dict(module, optimizer, model_state_dict=weights, optim_state_dict=named,
                       options=StateDictOptions(full_state_dict=True))
