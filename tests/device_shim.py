"""A CPU that plays a CUDA GPU, for the code paths that only a GPU runs (issue 65).

Inside ``played_gpu()``, tensors moved or created on ``cuda`` are computed on the CPU but behave as a GPU's do to
the code that holds them: their ``.device`` is ``cuda:0``, ``.numpy()`` on them raises torch's own TypeError
("can't convert cuda:0 device type tensor to numpy"), and an operation that mixes them with CPU tensors raises
torch's RuntimeError ("Expected all tensors to be on the same device") — 0-dim CPU tensors excepted, as CUDA
accepts them, and CPU indices into a GPU tensor, as CUDA accepts those too. So the class of bug that crashed the
first GPU run (``labels.numpy()`` on labels the trainer had moved) fails a CPU test, wherever it is.

It also counts what costs a GPU its pace: host -> device copies, device -> host copies and the reads that wait for
the device (``.item()``, ``.tolist()``, ``float(t)``, a boolean mask's size): ``shim.counts``.

``torch.cuda``'s functions that the code calls are played too (``is_available``, ``device_count`` = ``gpus``, the
RNG states of every visible GPU, ``mem_get_info``, ``synchronize``, ...), so ``set_rng_state_all`` with more states
than visible GPUs fails as CUDA's does (IndexError).

What it is not: a GPU's numerics (it computes in fp32 on the CPU whatever autocast says), its memory limits, or
torch.compile's CUDA backend (compiled paths are counted with ``torch._dynamo.explain`` instead).
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
# ops that move data between the devices (each direction counted), and reads that wait for the device
COPIES = {aten._to_copy.default, aten.copy_.default}
# (CUDA's bincount reads its input's min and max back to size its output: SummaryOps.cu)
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
         aten.bincount.default}
# CUDA indexes a GPU tensor with CPU indices (the indices are copied over); the other way round it refuses
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def _is_cuda(device: Any) -> bool:
    return isinstance(device, (str, torch.device, int)) and not isinstance(device, bool) and \
        torch.device(device).type == "cuda"


# C++ functions and tensor methods, whose scratch tensors follow their inputs' device (the shim's _Looks)
BUILTINS = (type(torch.zeros), type(torch.Tensor.add_))
# C++ functions that read their values on the CPU but not on CUDA (there a device assert checks them): F.one_hot's
# class checks (min >= 0; max < num_classes), "rely on device assert thrown by scatter" on CUDA (Onehot.cpp)
NO_READS_ON_CUDA = {torch.nn.functional.one_hot}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class PlayedGPU:
    """The state of one ``played_gpu()``: which storages are on the GPU (a tensor is where its storage is, so
    views and ``param.data = ...`` follow), and the counts."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.counts: Counter[str] = Counter()
        self._thread = threading.local()  # (a C++ function's depth is its thread's: another thread's factories
        # made while the training thread is inside one are the CPU's)

    @property
    def inherit(self) -> int:
        """Inside a C++ function called with GPU tensors (on this thread): its new tensors are the GPU's."""
        return getattr(self._thread, "inherit", 0)

    @inherit.setter
    def inherit(self, depth: int) -> None:
        self._thread.inherit = depth

    def on(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage() in self._storages
        except (RuntimeError, NotImplementedError):  # no storage (meta, sparse): not the played GPU's
            return False

    def mark(self, out: Any) -> Any:
        for t in _tensors(out):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                self._storages[t.untyped_storage()] = True
        return out

    def syncs(self) -> int:
        """Copies to the host and reads that wait for the device (a host -> device copy from pinned memory does not
        wait; from pageable memory it does, and those are counted apart as ``host_to_device``)."""
        return self.counts["device_to_host"] + self.counts["device_reads"]

    def reset(self) -> None:
        self.counts.clear()


class _OnDevice(TorchDispatchMode):
    """Below autograd: marks what GPU tensors' operations make, refuses mixing, counts copies and reads."""

    def __init__(self, shim: PlayedGPU) -> None:
        super().__init__()
        self.shim = shim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on = self.shim.on
        if func is aten.copy_.default:  # copy_(dst, src): either way is a copy between devices, not a mix
            if on(args[0]) != on(args[1]):
                self.shim.counts["host_to_device" if on(args[0]) else "device_to_host"] += 1
            return func(*args, **kwargs)
        tensors = _tensors(args) + _tensors(kwargs)
        gpu = any(on(t) for t in tensors)
        if not tensors and self.shim.inherit:
            return self.shim.mark(func(*args, **kwargs))  # a C++ function's scratch tensor on a GPU (_Looks)
        if gpu:
            if func in READS or (func in INDEXING and any(t is not None and t.dtype in (torch.bool, torch.uint8)
                                                            for t in _tensors(args[1]))):
                self.shim.counts["device_reads"] += 1  # (a boolean mask's size is read by the host: nonzero)
            mixed = [t for t in tensors if not on(t) and t.dim() > 0]
            if mixed and not (func in INDEXING and on(args[0])):  # CUDA copies CPU indices over by itself
                raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:0 and cpu! (played GPU: {func} with a CPU tensor of shape "
                                   f"{tuple(mixed[0].shape)})")
        out = func(*args, **kwargs)
        return self.shim.mark(out) if gpu else out


class _Looks(TorchFunctionMode):
    """Above autograd: moving to and from the GPU, creating on it, and what a GPU tensor looks like from Python."""

    def __init__(self, shim: PlayedGPU) -> None:
        super().__init__()
        self.shim = shim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        shim, owner = self.shim, getattr(func, "__self__", None)
        if owner is torch.Tensor.device and shim.on(args[0]):
            return CUDA
        if owner is torch.Tensor.is_cuda and shim.on(args[0]):
            return True
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and shim.on(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                            "host memory first. (played GPU)")
        if func is torch.Tensor.pin_memory or func is torch.Tensor.is_pinned:
            return args[0] if func is torch.Tensor.pin_memory else True
        if func is torch.Tensor.tolist and shim.on(args[0]):
            shim.counts["device_reads"] += 1
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if isinstance(kwargs.get("generator"), _PlayedGenerator) and not (
                _is_cuda(kwargs.get("device")) or any(shim.on(t) for t in _tensors(args))):
            # a GPU's generator draws GPU tensors only: torch.rand(n, generator=gpu_gen) without device= raises on
            # CUDA (issue 80, T4); played, the generator is a CPU one and the draw worked
            raise RuntimeError("Expected a 'cpu' device type for generator but found 'cuda' (played GPU: "
                               f"{getattr(func, '__name__', func)} with the GPU's generator draws on the CPU)")
        if isinstance(func, BUILTINS) and any(shim.on(t) for t in _tensors(args) + _tensors(kwargs)):
            # a C++ function allocates from its inputs' options, so on a GPU its scratch tensors are the GPU's
            # (F.one_hot: zeros, then scatter_ of the labels): here they would be the CPU's, and the mix refused.
            # (A Python function's own torch.zeros(n) without device= stays on the CPU, as on a GPU.)
            shim.inherit += 1
            reads = shim.counts["device_reads"]
            try:
                return func(*args, **kwargs)
            finally:
                shim.inherit -= 1
                if func in NO_READS_ON_CUDA:
                    shim.counts["device_reads"] = reads
        if _is_cuda(kwargs.get("device")):  # a factory (torch.zeros(..., device="cuda"), torch.tensor, new_*)
            kwargs["device"] = torch.device("cpu")
            kwargs.pop("pin_memory", None)
            out = func(*args, **kwargs)
            ins = {id(t.untyped_storage()) for t in _tensors(args)}
            if any(id(t.untyped_storage()) in ins for t in _tensors(out)):  # as_tensor of a CPU tensor: a copy on a GPU
                out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
                shim.counts["host_to_device"] += 1
            return shim.mark(out)
        return func(*args, **kwargs)

    def _move(self, func, args, kwargs):
        t, shim = args[0], self.shim
        if func is torch.Tensor.cuda:
            device, dtype = CUDA, None
        elif func is torch.Tensor.cpu:
            device, dtype = torch.device("cpu"), None
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): other's device and dtype
            device, dtype = (CUDA if shim.on(args[1]) else torch.device("cpu")), args[1].dtype
        else:  # (_parse_to refuses copy=, which Tensor.to takes: GradScaler passes it)
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                        if k != "copy"})
        dtype = dtype or t.dtype
        if device is None or (device.type == "cuda") == shim.on(t):  # stays where it is (dtype may change)
            out = t.to(dtype=dtype, copy=bool(kwargs.get("copy")))
            return shim.mark(out) if shim.on(t) else out
        with _disable_current_modes():  # a copy between the devices: new storage, on the other side
            out = t.to(dtype=dtype, copy=True)
        if device.type == "cuda":
            shim.counts["host_to_device"] += 1
            return shim.mark(out)
        shim.counts["device_to_host"] += 1
        return out


_REAL_GENERATOR = torch.Generator


class _PlayedGenerator(_REAL_GENERATOR):
    """``torch.Generator(device="cuda")``: a CPU generator that says it is the GPU's (its draws are made where the
    call says, ``device=...``, and a draw on the GPU with it is not a copy)."""

    def __new__(cls, device: Any = "cpu"):
        if not _is_cuda(device):
            return _REAL_GENERATOR(device)
        return super().__new__(cls, "cpu")

    @property
    def device(self) -> torch.device:
        return CUDA

    # a GPU generator's state is not a CPU's (CUDA's Philox state is 16 bytes): played as the CPU state with a
    # marker, so that one kind's state refuses the other as CUDA's does
    MARK = torch.tensor([7, 7, 7, 7, 7, 7, 7, 7], dtype=torch.uint8)

    def get_state(self) -> torch.Tensor:
        return torch.cat([self.MARK, super().get_state()])

    def set_state(self, state: torch.Tensor) -> "_PlayedGenerator":
        if len(state) != len(self.MARK) + len(super().get_state()) or not torch.equal(state[:8], self.MARK):
            raise RuntimeError(f"RNG state is wrong size: a played GPU's generator, given a state of {len(state)} "
                               "bytes")
        super().set_state(state[8:].clone())
        return self


@contextlib.contextmanager
def played_gpu(gpus: int = 1, free_gib: float = 70.0) -> Iterator[PlayedGPU]:
    shim = PlayedGPU(gpus)
    states = [torch.get_rng_state() for _ in range(gpus)]

    def set_rng_state_all(new_states):
        for i, s in enumerate(new_states):  # as torch.cuda: default_generators[i] for each state given
            if i >= gpus:
                raise IndexError("tuple index out of range")
            states[i] = s.clone()

    def get_rng_state(device="cuda"):
        return states[torch.device(device).index or 0].clone()

    def set_rng_state(s, device="cuda"):
        i = torch.device(device).index or 0
        if i >= gpus:
            raise IndexError("tuple index out of range")
        states[i] = s.clone()

    patches = {"is_available": lambda: True, "device_count": lambda: gpus, "is_bf16_supported": lambda *a, **k: True,
               "get_device_name": lambda *a: "played GPU (CPU)", "get_device_capability": lambda *a: (9, 0),
               "synchronize": lambda *a, **k: None, "empty_cache": lambda: None, "set_device": lambda *a: None,
               "current_device": lambda: 0, "_lazy_init": lambda: None,
               "mem_get_info": lambda *a: (int(free_gib * 2**30), int(80 * 2**30)),
               "memory_allocated": lambda *a: 0, "max_memory_allocated": lambda *a: 0,
               "reset_peak_memory_stats": lambda *a: None,
               "get_rng_state_all": lambda: [s.clone() for s in states], "set_rng_state_all": set_rng_state_all,
               "get_rng_state": get_rng_state, "set_rng_state": set_rng_state,
               "manual_seed_all": lambda seed: None, "manual_seed": lambda seed: None}
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        stack.enter_context(mock.patch.object(torch, "Generator", _PlayedGenerator))
        # pinned host memory is a CUDA driver's: a played GPU's DataLoader hands plain host batches to .to("cuda")
        real_init = torch.utils.data.DataLoader.__init__
        stack.enter_context(mock.patch.object(torch.utils.data.DataLoader, "__init__",
                                              lambda self, *a, **k: real_init(self, *a, **{**k, "pin_memory": False})))
        stream = mock.Mock(is_capturing=lambda: False, synchronize=lambda: None, query=lambda: True)
        stack.enter_context(mock.patch.object(torch.accelerator, "current_stream", lambda *a: stream))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: stream))
        stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
        # torch's foreach paths (the optimizers, clip_grad_norm_, GradScaler's unscale) group tensors by the device
        # their storage reports, which is the CPU's: each group's tensors were then moved "to" it, counted as copies
        # to the host a GPU does not make. The groups of played tensors are the GPU's.
        real_group = torch.utils._foreach_utils._group_tensors_by_device_and_dtype

        def group(tensorlistlist, with_indices=False):
            groups = real_group(tensorlistlist, with_indices)
            played = lambda lists: any(shim.on(t) for ts in lists for t in ts if t is not None)  # noqa: E731
            return {((CUDA if played(lists) else device), dtype): (lists, idx)
                    for (device, dtype), (lists, idx) in groups.items()}
        import importlib  # (torch.optim's submodules are not attributes of it in every version)

        for name in ("torch.utils._foreach_utils", "torch.optim.optimizer", "torch.nn.utils.clip_grad"):
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "_group_tensors_by_device_and_dtype", group))
        # torch's modes are a thread's own: a thread started while the GPU is played (the device decode's, ahead of
        # the step) plays it too, or its .to("cuda") would reach the CPU build's CUDA and fail
        real_run = threading.Thread.run

        def run(thread):
            with _OnDevice(shim), _Looks(shim):
                real_run(thread)

        stack.enter_context(mock.patch.object(threading.Thread, "run", run))
        stack.enter_context(_OnDevice(shim))
        stack.enter_context(_Looks(shim))
        yield shim
