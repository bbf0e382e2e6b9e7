"""Inference throughput of vitkit against timm, Hugging Face, torchvision and onnxruntime on identical weights and
inputs; and vitkit's int8 ONNX export (outputs not identical: its relative logit error is reported)."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from ..interop.hf import to_hf
from ..interop.timm import timm_model, to_timm
from ..interop.torchvision import to_torchvision
from ..model.config import to_2tuple
from ..model.registry import create_model
from ..model.vit import VisionTransformer, flops_per_image
from ..runtime.inference import optimize_for_inference
from ..runtime.precision import dtype_of
from ..serving.onnx import INT8_LIMIT, relative_error
from .timing import interleaved_throughput


def _peer_timm(model: VisionTransformer) -> torch.nn.Module | None:
    try:
        ref = timm_model(model.config)
    except ImportError:  # timm is optional: the dev extra
        return None
    ref.load_state_dict(to_timm(model))
    return ref


def _peer_hf(model: VisionTransformer) -> torch.nn.Module | None:
    try:
        import transformers  # optional: the dev extra
    except ImportError:
        return None
    sd, cfg = to_hf(model)
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(d) / "model.safetensors"))
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        hf = transformers.ViTForImageClassification.from_pretrained(d)

    class Logits(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(pixel_values=x).logits

    return Logits(hf)


def _peer_torchvision(model: VisionTransformer) -> torch.nn.Module | None:
    try:
        return to_torchvision(model)
    except ValueError:
        return None


_ONNX: dict[str, dict[bool, torch.nn.Module]] = {}  # weights' digest -> {int8: session}: one export per model


def _onnx(model: VisionTransformer, int8: bool = False) -> torch.nn.Module | None:
    """``model`` exported to ONNX (int8 or fp32) and run by onnxruntime, if the onnx extra is installed. Both
    files come from one export, kept for the process: the batch sizes of one model share them."""
    try:
        from ..serving.onnx import OnnxModel, export_onnx, quantize_int8  # needs the onnx extra
        import onnxruntime  # noqa: F401  optional: the onnx extra
    except ImportError:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for t in model.state_dict().values():
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    key = digest.hexdigest()
    if key not in _ONNX:
        with tempfile.TemporaryDirectory() as d:
            fp32, q = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
            export_onnx(model, fp32, atol=1e-3)
            quantize_int8(fp32, q)  # checked against PyTorch by bench_inference, on the inputs it times
            _ONNX[key] = {False: OnnxModel(fp32), True: OnnxModel(q)}  # the sessions hold the graphs: files may go
    return _ONNX[key][int8]


PEERS: dict[str, Callable[[VisionTransformer], torch.nn.Module | None]] = {
    "timm": _peer_timm, "hf": _peer_hf, "torchvision": _peer_torchvision, "onnxruntime": _onnx}
FP32_ONLY = ("onnxruntime",)  # peers timed in fp32 only (onnxruntime runs the fp32 export)


def _runner(m: torch.nn.Module, x: torch.Tensor, mode: str) -> Callable[[], Any]:
    """mode: fp32 | bf16-autocast | bf16-weights (for peers) ; vitkit handles its own casting."""
    if mode == "bf16-weights":  # a copy: the same peer also runs in the other modes
        m = copy.deepcopy(m).to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    ctx = (lambda: torch.autocast(x.device.type, dtype=torch.bfloat16)) if mode == "bf16-autocast" \
        else contextlib.nullcontext

    def run() -> Any:
        with torch.inference_mode(), ctx():
            return m(x)

    return run


def bench_inference(name: str, batch: int, dtype: str, peers: tuple[str, ...] = tuple(PEERS),
                    repeats: int = 5, compile: bool = False, log: Callable[[str], None] = print, int8: bool = False,
                    device: torch.device | str = "cpu", **overrides: Any) -> list[dict[str, Any]]:
    """Rows of {impl, mode, img_s, ...} for one model/batch/dtype on ``device``; all on the same weights and inputs.
    ``int8`` (fp32 groups, CPU): also vitkit's int8 ONNX export, whose ``max_abs_diff`` is then its relative logit
    error. On a GPU each row also has ``gpu_mem_mb``: the peak memory its first call allocated."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = create_model(name, **overrides).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    c = model.config
    x = torch.randn(batch, c.in_chans, *to_2tuple(c.img_size))
    with torch.inference_mode():
        want = model(x)  # the fp32 reference, on the CPU
    x = x.to(device)
    cuda = device.type == "cuda"
    runners: list[tuple[str, str, Callable[[], Any], float, str]] = []
    memory: list[float | None] = []

    def add(impl: str, mode: str, fn: Callable[[], Any], compute: str = dtype) -> None:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        out = fn()  # also the first warm-up (and the compilation of a compiled model)
        memory.append(torch.cuda.max_memory_allocated(device) / 2 ** 20 if cuda else None)
        logits = (out.float() if isinstance(out, torch.Tensor) else out).cpu()
        err = float((logits - want).abs().max())
        tol = 1e-3 if compute == "fp32" else 0.5
        if compute == "int8":  # int8 changes the logits: a relative bound that only a broken export exceeds
            err, tol = relative_error(logits, want), INT8_LIMIT
        if err > tol:  # proves the peers run the same weights; bf16 only roughly agrees
            raise RuntimeError(f"{impl} ({mode}) disagrees with vitkit by {err:.3g}: not the same model")
        runners.append((impl, mode, fn, err, compute))

    for compiled in (False, True) if compile else (False,):
        # "auto": the dtype optimize_for_inference times here at this batch (cached), as predict/eval/serve use it
        fast = optimize_for_inference(model.to(device), "auto" if dtype == "auto" else dtype_of(dtype),
                                      compile=compiled, batch_size=batch)
        if fast.compile_note:
            log(f"  {fast.compile_note}")
        add("vitkit", "optimized" + (f" ({fast.precision})" if dtype == "auto" else "")
            + ("+compile" if compiled else ""), lambda fast=fast: fast(x),
            fast.precision)
    model = model.cpu()  # the peers are converted from the CPU copy, then moved
    if int8 and not cuda and dtype in ("fp32", "auto") and (q := _onnx(model, int8=True)) is not None:
        add("vitkit", "int8 onnx (onnxruntime)", _runner(q, x, "fp32"), "int8")
    modes = {"fp32": ("fp32",), "bf16": ("bf16-autocast", "bf16-weights")}.get(
        dtype, ("fp32", "bf16-autocast", "bf16-weights"))  # auto: every peer in each of its dtypes
    for peer in peers:
        if peer in FP32_ONLY and (dtype == "bf16" or cuda):  # onnxruntime runs here on the CPU
            continue
        m = PEERS[peer](model)
        if m is None:
            continue
        m.eval().to(device)
        for mode in modes if peer not in FP32_ONLY else ("fp32",):
            add(peer, mode, _runner(m, x, mode), "fp32" if mode == "fp32" else "bf16")
    # interleaved: every repeat times each implementation once, so a machine that drifts affects all alike
    speeds = interleaved_throughput([fn for _, _, fn, _, _ in runners], batch, repeats=repeats, device=device)
    rows = []
    for (impl, mode, _, err, compute), r, mem in zip(runners, speeds, memory):
        rows.append({"model": name, "batch": batch, "dtype": dtype, "compute": compute, "impl": impl, "mode": mode,
                     "img_s": r, "gflop_per_img": flops_per_image(c) / 1e9, "max_abs_diff": err,
                     "device": str(device), **({"gpu_mem_mb": round(mem, 1)} if mem is not None else {})})
        log(f"  {name} b{batch} {dtype:<4} {impl:<11} {mode:<24} {r:8.2f} img/s"
            + (f"  {mem:,.0f} MiB" if mem is not None else ""))
    return rows
