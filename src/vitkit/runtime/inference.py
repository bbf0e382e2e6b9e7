"""``optimize_for_inference``: a model prepared for the fastest inference on its device (docs: Speed).

- The weights' dtype (fp32 or bf16 weights, not autocast: no re-cast of every weight on every call; ViT-B/16 batch
  16 on an AMX CPU: 41 vs 32 img/s) is the faster of the two *timed here* on the model's own forward, cached per
  machine (runtime/calibrate.py): bf16 was 3x faster than fp32 on one CPU with AVX512-BF16 and half as fast on
  another with the same flag.
- The attention path (PyTorch's fused SDPA, or the exact two matmuls and softmax) timed with the dtype.
- How a linear layer adds its bias, timed on the chosen dtype and path: in the matmul (``addmm``, PyTorch's
  default) or after it, in place (``split``), with the same logits. In bf16 on a CPU oneDNN's ``addmm`` can be
  slower than the matmul alone (the measurement is in docs: Speed); a GPU's matmul adds the bias for free.
- The last encoder layer computed for the tokens the head reads only (model/readout.py): the same logits, ~7% less
  work for ViT-B/16, nothing to time.
- Optionally torch.compile with Inductor's max-autotune and freezing.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..model.naflex import NaFlexBatch
from ..model.readout import readout_logits
from ..model.vit import set_attention
from .calibrate import Calibration, calibrate
from .cpu import cpu_precisions
from .precision import DTYPES, precision_of


CALIBRATION_BATCH = 32
# The bias after the matmul is taken only where it timed this much faster than inside it: in fp32 on an AVX2-only
# EPYC it won the calibration by 0.6% (5366 against 5399 ms, noise), then ran 4% slower than addmm over 8 paired
# rounds (ViT-B/16 batch 16); in bf16 on an AVX512-BF16 EPYC its real gain was 2-3% (docs: Speed).
SPLIT_MARGIN = 0.02


class SplitBiasLinear(nn.Module):
    """A Linear for inference whose bias is added in place after the matmul instead of inside it (``addmm``); the
    same parameters, under the same names, and the sizes a Linear reports (code that reads ``in_features`` keeps
    working on a prepared model)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.t()).add_(self.bias)


def split_bias(model: nn.Module) -> int:
    """Every Linear of ``model`` with a bias becomes a SplitBiasLinear (inference only: the in-place add has no
    gradient to keep). Returns how many."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.bias is not None]
    for parent, name, child in found:
        setattr(parent, name, SplitBiasLinear(child))
    return len(found)


def inference_candidates(device: torch.device) -> list[dict[str, str]]:
    """The weights' dtypes and attention paths worth timing on ``device`` (on a CPU, bf16 where its matmuls are not
    much slower than fp32's: runtime/cpu.cpu_precisions). The exact path (two matmuls and a softmax) beat PyTorch's
    fused attention for bf16 ViT-B/16 inference on an AMD EPYC with AVX512-BF16, where bf16 is the faster dtype
    (1726 against 1845 ms for batch 16, `python benchmarks/plan_check.py`), so both are candidates."""
    if device.type == "cuda":
        dtypes = ["bf16", "fp32"] if torch.cuda.is_bf16_supported(including_emulation=False) else ["fp16", "fp32"]
    elif device.type == "cpu":
        dtypes = cpu_precisions()[0]
    else:
        dtypes = ["fp32"]
    return [{"dtype": d, "attention": a} for d in dtypes for a in ("sdpa", "exact")]


def choose_inference_dtype(model: nn.Module, batch_size: int = 8, refresh: bool = False
                           ) -> tuple[torch.dtype | None, Calibration]:
    """The faster weights' dtype for ``model``'s forward on its device at ``batch_size`` (None: fp32), timed here
    (cached per machine and model shape) and the timings (``.best.settings["attention"]``: the faster path)."""
    device = next(model.parameters()).device
    c = model.config
    x = torch.randn(batch_size, c.in_chans, *_hw(c.img_size), device=device)

    def make(s: dict[str, str]) -> Callable[[], object]:
        m = copy.deepcopy(model).eval().to(DTYPES[s["dtype"]])
        set_attention(m, s["attention"])
        if s.get("bias") == "split":
            split_bias(m)
        xs = x.to(DTYPES[s["dtype"]])

        def forward() -> object:
            with torch.inference_mode():
                out = readout_logits(m, xs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        return forward

    workload = {"kind": "inference", "model": c.to_dict(), "batch": batch_size, "device": device.type,
                "threads": torch.get_num_threads(), "forward": "readout"}
    what = f"inference forward (batch {batch_size})"
    cal = calibrate(what, device, workload, inference_candidates(device), make, refresh=refresh, rounds=3,
                    budget_s=3.0)
    # then where the bias goes, on the fastest dtype and path only (a second full sweep would double the cost);
    # more rounds: the two differ by a few percent
    fastest = {**cal.best.settings, "bias": "addmm"}
    bias = calibrate(f"{what}, the linear layers' bias", device, {**workload, "after": cal.best.settings},
                     [fastest, {**fastest, "bias": "split"}], make, refresh=refresh, rounds=5, budget_s=6.0)
    split_s, addmm_s = bias.seconds_of(**{**fastest, "bias": "split"}), bias.seconds_of(**fastest)
    if split_s is not None and addmm_s is not None and split_s > (1 - SPLIT_MARGIN) * addmm_s:
        bias.chosen = fastest  # PyTorch's own way, unless the other is clearly faster
    cal = cal.then(bias)
    best = cal.best.settings["dtype"]
    return (None if best == "fp32" else DTYPES[best]), cal


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)  # type: ignore[return-value]


def optimize_for_inference(model: nn.Module, dtype: torch.dtype | None | str = "auto",
                           compile: bool | str = False, batch_size: int = 8) -> "InferenceModel":
    """A copy of ``model`` in eval mode for the fastest inference on its device: weights in ``dtype`` (``"auto"``,
    the default: the fastest of fp32 and bf16, each with fused or exact attention, and the linear layers' bias in
    or after the matmul, timed here at ``batch_size`` and cached; None: fp32; or a torch dtype, with fused
    attention), and optionally torch.compile. Inputs may be fp32: they are cast on entry; logits come back in
    fp32. ``.calibration`` holds the timings when the dtype was chosen here.

    ``compile``: True compiles in the mode that pays on the device (``compile_mode``), or name a torch.compile mode.
    ``.compile_note`` says what the first call will cost, for a caller to print before making it."""
    device = next(model.parameters()).device
    cal, attention = None, "sdpa"
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ValueError(f"dtype must be 'auto', None or a torch dtype, got {dtype!r}")
        # timed at no more than CALIBRATION_BATCH images: an evaluation's batch of 256 would take minutes in fp32 on a
        # ViT-B/16, and the per-image cost is flat past a few dozen images on a CPU
        dtype, cal = choose_inference_dtype(model, min(batch_size, CALIBRATION_BATCH))
        attention = cal.best.settings.get("attention", "sdpa") if cal is not None else "sdpa"
    m = copy.deepcopy(model).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    if dtype is not None:
        m = m.to(dtype)
    set_attention(m, attention)
    if cal is not None and cal.best.settings.get("bias") == "split":
        split_bias(m)
    if not compile:
        return InferenceModel(m, dtype, calibration=cal)
    mode = compile if isinstance(compile, str) else compile_mode(device)
    fast = InferenceModel(m, dtype, compiled=torch.compile(_Readout(m), mode=mode), calibration=cal)
    fast.compile_note = COMPILE_COST.get((device.type, mode), f"torch.compile mode {mode}: compiles on the first "
                                         "call for each input shape")
    return fast


def compile_mode(device: torch.device) -> str:
    """torch.compile's mode for inference on ``device``. CPU: max-autotune lets Inductor choose its own C++ GEMMs
    (AMX micro-kernels with bias/GELU fused in) where they beat oneDNN, and freezing folds the weights in as
    constants: ViT-B/16 batch 16 bf16, 43.8 vs 40.9 img/s eager; without either, no gain. CUDA: the default mode;
    max-autotune benchmarked 22 GEMM choices per shape, 168 s to compile ViT-B/16 on an H100 against timm's 15 s
    with the default mode, for a 7% gain."""
    return "max-autotune" if device.type == "cpu" else "default"


COMPILE_COST = {  # what the first call costs, measured; printed before it
    ("cpu", "max-autotune"): "compiling (torch.compile, max-autotune): ~12-25 s per input shape on a CPU",
    ("cuda", "default"): "compiling (torch.compile, default mode): ~15 s per input shape for a ViT-B/16 on a GPU",
    ("cuda", "max-autotune"): "compiling (torch.compile, max-autotune): ~170 s per input shape for a ViT-B/16 on an "
                              "H100 (22 GEMM choices timed per shape)",
}


class InferenceModel(nn.Module):
    """What ``optimize_for_inference`` returns: the prepared ViT (``.model``, in ``.dtype``; None = fp32) and, when
    compiled, its compiled forward. Casts inputs to the weights' dtype and logits back to fp32, without autograd.
    ``forward_attention`` always runs the uncompiled model (the exact path records the attention maps)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, compiled: Callable | None = None,
                 calibration: Calibration | None = None) -> None:
        super().__init__()
        self.model, self.dtype, self.calibration = model, dtype, calibration
        self.compile_note: str | None = None  # compiled: what the first call costs
        self.__dict__["_compiled"] = compiled  # not a submodule: state_dict and modules() see the model once

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.model.config

    @property
    def precision(self) -> str:
        return precision_of(self.dtype)

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, NaFlexBatch):
            return x.replace(patches=x.patches.to(self.dtype)) if self.dtype is not None else x
        return x.to(self.dtype) if self.dtype is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._compiled is None or isinstance(x, NaFlexBatch):  # (compiled for the fixed-size batch)
            with torch.inference_mode():
                return readout_logits(self.model, self._cast(x)).float()
        with _frozen_no_grad():  # Dynamo cannot trace under inference_mode
            return self._compiled(self._cast(x)).float()

    def forward_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.inference_mode():
            logits, attns = self.model.forward_attention(self._cast(x))
        return logits.float(), [a.float() for a in attns]


class _Readout(nn.Module):
    """``readout_logits`` of a model as a module, for torch.compile (its weights frozen in as the model's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return readout_logits(self.model, x)


@contextlib.contextmanager
def _frozen_no_grad() -> Iterator[None]:
    import torch._inductor.config as inductor_config  # Inductor's config is read when compiling: set per call

    with torch.no_grad(), inductor_config.patch(freezing=True):
        yield
