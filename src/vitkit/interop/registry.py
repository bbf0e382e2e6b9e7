"""Pretrained weights that fit vitkit's models, under timm's ``name.tag`` spelling, Hugging Face ids and the
official ``.npz`` files' paths on Google Cloud Storage.

Each entry says where the file is, which architecture it implies, how its images were prepared (size, mean/std,
interpolation, crop fraction, as its publisher evaluates it), its label set, licence, and the ImageNet-1k top-1 its
publisher reports. Top-1 for timm entries: timm's ``results/results-imagenet.csv`` (huggingface/pytorch-image-models,
ImageNet-1k validation at the entry's size and crop); none is given where the publisher reports none for that file.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

HALF = (0.5, 0.5, 0.5)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TIMM_TOP1 = "timm results-imagenet.csv"
GCS = "https://storage.googleapis.com/vit_models/"


@dataclass(frozen=True)
class Pretrained:
    name: str  # how vitkit.create_model / --model / --init call it
    arch: str  # the vitkit preset it loads into
    hub: str | None = None  # Hugging Face repo id, or
    url: str | None = None  # a direct URL
    filename: str = "model.safetensors"
    fmt: str = "timm"  # the layout of the file: timm | hf | jax
    img_size: int = 224
    mean: tuple[float, ...] = HALF
    std: tuple[float, ...] = HALF
    interpolation: str = "bicubic"
    crop_pct: float = 0.9
    crop_mode: str = "center"  # center: resize the short side to img_size / crop_pct, then crop; squash: resize both
    labels: str | None = "imagenet-1k"  # imagenet-1k | imagenet-21k | None (features only)
    num_classes: int = 1000
    license: str = "apache-2.0"
    top1: float | None = None
    top1_source: str | None = None
    sha256: str | None = None  # checked after download where known
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return f"hf.co/{self.hub}/{self.filename}" if self.hub else str(self.url)

    def preprocessing(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "interpolation": self.interpolation,
                "crop_pct": self.crop_pct, "crop_mode": self.crop_mode}


def _timm(name: str, top1: float | None, *, arch: str | None = None, **kw: Any) -> Pretrained:
    size = kw.pop("img_size", 384 if "_384" in name else 224)
    kw.setdefault("crop_pct", 1.0 if size == 384 else 0.9)
    if name.endswith(("augreg_in21k", "orig_in21k")):
        kw.setdefault("labels", "imagenet-21k" if name.endswith("augreg_in21k") else None)
        kw.setdefault("num_classes", 21843 if name.endswith("augreg_in21k") else 0)
    return Pretrained(name, arch or name.split(".")[0].replace("deit_", "vit_"), hub=f"timm/{name}", img_size=size,
                      top1=top1, top1_source=TIMM_TOP1 if top1 is not None else None, **kw)


def _hf(repo: str, arch: str, *, num_classes: int = 1000, labels: str | None = "imagenet-1k",
        mae: bool = False) -> Pretrained:
    size = 384 if "384" in repo else 224
    # transformers' ViTImageProcessor for these repos: resize both sides to the size (bilinear), mean/std 0.5; the
    # MAE repos' processor standardises with ImageNet's mean/std, and their licence is CC BY-NC 4.0
    norm = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "license": "cc-by-nc-4.0"} if mae else {}
    return Pretrained(repo, arch, hub=repo, fmt="hf", img_size=size, interpolation="bilinear", crop_pct=1.0,
                      crop_mode="squash", labels=labels, num_classes=num_classes, **norm)


def _npz(path: str, arch: str, *, num_classes: int = 1000, labels: str | None = "imagenet-1k",
         img_size: int = 224) -> Pretrained:
    return Pretrained(f"jax/{path}", arch, url=f"{GCS}{path}.npz", filename=path.rsplit("/", 1)[-1] + ".npz",
                      fmt="jax", img_size=img_size, crop_pct=1.0 if img_size == 384 else 0.9, labels=labels,
                      num_classes=num_classes)


IN21K = dict(num_classes=21843, labels="imagenet-21k")
DEIT = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD)
ENTRIES: list[Pretrained] = [
    # AugReg ("How to train your ViT?", Steiner et al. 2021) and the paper's original weights, as timm hosts them
    _timm("vit_tiny_patch16_224.augreg_in21k_ft_in1k", 75.454),
    _timm("vit_tiny_patch16_224.augreg_in21k", None),
    _timm("vit_tiny_patch16_384.augreg_in21k_ft_in1k", 78.424),
    _timm("vit_small_patch16_224.augreg_in21k_ft_in1k", 81.384),
    _timm("vit_small_patch16_224.augreg_in1k", 78.846),
    _timm("vit_small_patch16_224.augreg_in21k", None),
    _timm("vit_small_patch16_384.augreg_in21k_ft_in1k", 83.802),
    _timm("vit_small_patch32_224.augreg_in21k_ft_in1k", 75.994),
    _timm("vit_base_patch16_224.augreg2_in21k_ft_in1k", 85.096),
    _timm("vit_base_patch16_224.augreg_in21k_ft_in1k", 84.532),
    _timm("vit_base_patch16_224.augreg_in1k", 79.154),
    _timm("vit_base_patch16_224.orig_in21k_ft_in1k", 81.786),
    _timm("vit_base_patch16_224.augreg_in21k", None),
    _timm("vit_base_patch16_224.orig_in21k", None),
    _timm("vit_base_patch16_384.augreg_in21k_ft_in1k", 85.996),
    _timm("vit_base_patch16_384.orig_in21k_ft_in1k", 84.200),
    _timm("vit_base_patch32_224.augreg_in21k_ft_in1k", 80.716),
    _timm("vit_base_patch8_224.augreg2_in21k_ft_in1k", 86.218),
    _timm("vit_large_patch16_224.augreg_in21k_ft_in1k", 85.834),
    _timm("vit_large_patch16_384.augreg_in21k_ft_in1k", 87.084),
    _timm("vit_huge_patch14_224.orig_in21k", None),
    # the paper's hybrids (§3.1)
    _timm("vit_tiny_r_s16_p8_224.augreg_in21k_ft_in1k", 71.798),
    _timm("vit_small_r26_s32_224.augreg_in21k_ft_in1k", 81.864),
    _timm("vit_base_r50_s16_384.orig_in21k_ft_in1k", 84.976),
    # DeiT (Touvron et al. 2021): the same architecture trained on ImageNet-1k alone, ImageNet mean/std
    _timm("deit_tiny_patch16_224.fb_in1k", 72.172, **DEIT),
    _timm("deit_small_patch16_224.fb_in1k", 79.844, **DEIT),
    _timm("deit_base_patch16_224.fb_in1k", 81.992, **DEIT),
    _timm("deit_base_patch16_384.fb_in1k", 83.106, **DEIT),
    # After the paper (docs "After the paper"): DeiT's distillation token (Touvron et al. 2021), DeiT III's LayerScale
    # (Touvron et al. 2022), DINOv2 with registers (Oquab et al. 2024; Darcet et al. 2024: features, no head, at the
    # 518 px its authors use), a GAP model with LayerScale (timm's own, "sw": ImageNet-12k then 1k)
    _timm("deit_small_distilled_patch16_224.fb_in1k", 81.218, arch="deit_small_distilled_patch16_224", **DEIT),
    _timm("deit_base_distilled_patch16_224.fb_in1k", 83.386, arch="deit_base_distilled_patch16_224", **DEIT),
    _timm("deit3_small_patch16_224.fb_in1k", 81.370, **DEIT),
    _timm("deit3_base_patch16_224.fb_in22k_ft_in1k", 85.700, crop_pct=1.0, **DEIT),
    _timm("vit_small_patch14_reg4_dinov2.lvd142m", None, img_size=518, crop_pct=1.0, labels=None, num_classes=0,
          **DEIT),
    _timm("vit_base_patch14_reg4_dinov2.lvd142m", None, img_size=518, crop_pct=1.0, labels=None, num_classes=0,
          **DEIT),
    _timm("vit_medium_patch16_gap_256.sw_in12k_ft_in1k", 84.446, img_size=256, crop_pct=0.95),
    # He et al.'s masked autoencoders (2021): ImageNet-1k images without their labels, the encoder alone, no head;
    # `vitkit train --init NAME` fine-tunes, `vitkit pretrain --method mae --init NAME` continues with a new decoder
    _timm("vit_base_patch16_224.mae", None, labels=None, num_classes=0, license="cc-by-nc-4.0", **DEIT),
    _timm("vit_large_patch16_224.mae", None, labels=None, num_classes=0, license="cc-by-nc-4.0", **DEIT),
    _timm("vit_huge_patch14_224.mae", None, labels=None, num_classes=0, license="cc-by-nc-4.0", **DEIT),
    # Hugging Face (google/): the paper's weights converted by transformers
    _hf("google/vit-base-patch16-224", "vit_base_patch16_224"),
    _hf("google/vit-base-patch16-384", "vit_base_patch16_384"),
    _hf("google/vit-large-patch16-224", "vit_large_patch16_224"),
    _hf("google/vit-base-patch16-224-in21k", "vit_base_patch16_224", num_classes=0, labels=None),
    _hf("google/vit-huge-patch14-224-in21k", "vit_huge_patch14_224", num_classes=0, labels=None),
    # ... and with their decoder (ViTMAEForPreTraining: `vitkit pretrain --method mae --init` continues with it)
    _hf("facebook/vit-mae-base", "vit_base_patch16_224", num_classes=0, labels=None, mae=True),
    _hf("facebook/vit-mae-large", "vit_large_patch16_224", num_classes=0, labels=None, mae=True),
    _hf("facebook/vit-mae-huge", "vit_huge_patch14_224", num_classes=0, labels=None, mae=True),
    # the official files of google-research/vision_transformer (README "Available ViT models")
    _npz("imagenet21k/ViT-B_16", "vit_base_patch16_224", num_classes=0, labels=None),
    _npz("imagenet21k/ViT-B_32", "vit_base_patch32_224", num_classes=0, labels=None),
    _npz("imagenet21k/ViT-L_16", "vit_large_patch16_224", num_classes=0, labels=None),
    _npz("imagenet21k+imagenet2012/ViT-B_16", "vit_base_patch16_384", img_size=384),
    _npz("imagenet21k+imagenet2012/ViT-B_16-224", "vit_base_patch16_224"),
    _npz("imagenet21k+imagenet2012/ViT-L_16", "vit_large_patch16_384", img_size=384),
    _npz("imagenet21k+imagenet2012/R50+ViT-B_16", "vit_base_r50_s16_384", img_size=384),
    _npz("augreg/Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", "vit_tiny_patch16_224", **IN21K),
    _npz("augreg/S_16-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
         "vit_small_patch16_224"),
    _npz("augreg/R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
         "vit_tiny_r_s16_p8_224"),
]
PRETRAINED: dict[str, Pretrained] = {e.name: e for e in ENTRIES}


def default_tag(arch: str) -> Pretrained | None:
    """The first entry for a bare architecture name, as timm picks one (``vit_base_patch16_224`` ->
    ``.augreg2_in21k_ft_in1k``)."""
    return next((e for e in ENTRIES if e.name.split(".")[0] == arch and e.hub and e.hub.startswith("timm/")), None)


def get_pretrained(name: str) -> Pretrained:
    if name in PRETRAINED:
        return PRETRAINED[name]
    entry = default_tag(name)
    if entry is not None:
        return entry
    close = difflib.get_close_matches(name, PRETRAINED, n=3, cutoff=0.5)
    raise ValueError(f"no pretrained weights named {name!r}" + (f"; did you mean {close}?" if close else "")
                     + " (`vitkit models --pretrained` lists them)")


def list_pretrained(pattern: str = "") -> list[Pretrained]:
    return [e for e in ENTRIES if pattern in e.name]
