"""Inference throughput of vitkit against timm, Hugging Face and torchvision on identical weights and inputs."""
from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from ..interop.hf import to_hf
from ..interop.timm import timm_kwargs, to_timm
from ..interop.torchvision import to_torchvision
from ..model.config import to_2tuple
from ..model.registry import create_model
from ..model.vit import VisionTransformer, flops_per_image
from ..runtime.inference import optimize_for_inference
from ..runtime.precision import dtype_of, precision_of
from .timing import interleaved_throughput


def _peer_timm(model: VisionTransformer) -> torch.nn.Module | None:
    try:
        from timm.models.vision_transformer import VisionTransformer as TimmViT  # optional: the dev extra
    except ImportError:
        return None

    ref = TimmViT(**timm_kwargs(model.config))
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


PEERS: dict[str, Callable[[VisionTransformer], torch.nn.Module | None]] = {
    "timm": _peer_timm, "hf": _peer_hf, "torchvision": _peer_torchvision}


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


def bench_inference(name: str, batch: int, dtype: str, peers: tuple[str, ...] = ("timm", "hf", "torchvision"),
                    repeats: int = 5, compile: bool = False, log: Callable[[str], None] = print,
                    **overrides: Any) -> list[dict[str, Any]]:
    """Rows of {impl, mode, img_s, ...} for one model/batch/dtype; all on the same weights and inputs."""
    torch.manual_seed(0)
    model = create_model(name, **overrides).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    c = model.config
    x = torch.randn(batch, c.in_chans, *to_2tuple(c.img_size))
    with torch.inference_mode():
        want = model(x)
    runners: list[tuple[str, str, Callable[[], Any], float, str]] = []

    def add(impl: str, mode: str, fn: Callable[[], Any], compute: str = dtype) -> None:
        out = fn()  # also the first warm-up (and the compilation of a compiled model)
        logits = out.float() if isinstance(out, torch.Tensor) else out
        err = float((logits - want).abs().max())
        tol = 1e-3 if dtype == "fp32" else 0.5
        if err > tol:  # proves the peers run the same weights; bf16 only roughly agrees
            raise RuntimeError(f"{impl} ({mode}) disagrees with vitkit by {err:.3g}: not the same model")
        runners.append((impl, mode, fn, err, compute))

    for compiled in (False, True) if compile else (False,):
        fast = optimize_for_inference(model, dtype_of(dtype), compile=compiled)
        kernel = any(getattr(m, "impl", None) == "cpu_kernel" for m in fast.modules())  # vitkit's AMX attention kernel
        fp32_here = dtype == "bf16" and precision_of(fast.dtype) == "fp32"  # a CPU without native bf16: fp32 is faster
        add("vitkit", "optimized" + ("+compile" if compiled else "") + ("+kernel" if kernel else "")
            + (", fp32" if fp32_here else ""), lambda fast=fast: fast(x), "fp32" if fp32_here else dtype)
    modes = ("fp32",) if dtype == "fp32" else ("bf16-autocast", "bf16-weights")
    for peer in peers:
        m = PEERS[peer](model)
        if m is None:
            continue
        m.eval()
        for mode in modes:
            add(peer, mode, _runner(m, x, mode))
    # interleaved: every repeat times each implementation once, so a machine that drifts affects all alike
    speeds = interleaved_throughput([fn for _, _, fn, _, _ in runners], batch, repeats=repeats)
    rows = []
    for (impl, mode, _, err, compute), r in zip(runners, speeds):
        rows.append({"model": name, "batch": batch, "dtype": dtype, "compute": compute, "impl": impl, "mode": mode,
                     "img_s": r, "gflop_per_img": flops_per_image(c) / 1e9, "max_abs_diff": err})
        log(f"  {name} b{batch} {dtype:<4} {impl:<11} {mode:<24} {r:8.2f} img/s")
    return rows
