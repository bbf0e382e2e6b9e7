"""The one source of truth for a model: a frozen dataclass, and the paper's Table 1 as named instances."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .fields import check_keys, check_range, coerce_fields

POOLS = ("cls", "gap", "map")
POS_EMBEDS = ("learn", "sincos2d", "none")
MLP_ACTS = ("gelu", "gelu_tanh")
POS_INTERPS = ("bicubic", "bilinear")
AFTER_PAPER = ("dist_token", "reg_tokens", "no_embed_class", "layer_scale", "qk_norm")


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    if isinstance(x, (str, bytes)):  # "224" would otherwise be read as the pair of its characters
        raise ValueError(f"expected an int or a pair (H, W), got {x!r}")
    t = tuple(int(v) for v in x)
    if len(t) != 2:
        raise ValueError(f"expected an int or a pair (H, W), got {x!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True)
class ViTConfig:
    """Hyper-parameters of a Vision Transformer (Dosovitskiy et al., 2021).

    ``img_size`` and ``patch_size`` may be an int or ``(H, W)``. ``hybrid`` names a CNN whose feature map
    replaces the image (§3.1, Hybrid): the paper's own ResNet with group norm and weight-standardised convolutions
    (``"resnetv2:3,4,9"``: the stages' block counts of R50+ViT-B/16; ``"resnetv2:"`` the root alone, as R+ViT-Ti/16),
    a torchvision ResNet stem (``"resnet50:3"``: the first 3 stages) or a few stride-1 3x3 convolutions
    (``"conv:32"``), the small-image stem of the Fashion-MNIST recipe.
    ``pool`` reads the image off the encoder: ``"cls"`` the class token (Eq. 4), ``"gap"`` the mean of the patch
    tokens, ``"map"`` multihead attention pooling (a learned probe attends over the tokens: big_vision, SigLIP).
    ``fc_norm`` moves the final LayerNorm after the pooling (timm's default for ``global_pool="avg"``).

    After the paper (docs: "After the paper"), each off by default, so the defaults are the paper's ViT:
    ``dist_token``, ``reg_tokens``, ``no_embed_class``, ``layer_scale``, ``qk_norm``.
    """

    img_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    pool: str = "cls"
    pos_embed: str = "learn"
    fc_norm: bool = False
    # §3.1: "The classification head is implemented by a MLP with one hidden layer at pre-training time and by a
    # single linear layer at fine-tuning time." The hidden layer, Dense + tanh of this width (the official code's
    # ``representation_size`` and ``pre_logits``, big_vision's ``rep_size``); None: the single linear layer.
    # Fine-tuning for other classes drops it with the head (model/hub.py), as the paper does.
    representation_size: int | None = None
    hybrid: str | None = None
    # DeiT (Touvron et al. 2021): a distillation token beside the class token, read by its own head; the two
    # heads' logits are averaged.
    dist_token: bool = False
    # Registers (Darcet et al. 2024, "Vision Transformers Need Registers"): tokens no head reads, which take over
    # the global computation that otherwise hijacks a few background patches.
    reg_tokens: int = 0
    # E_pos covers the patches only; the class/distillation/register tokens join after it is added (DeiT III,
    # DINOv2, big_vision): timm's ``no_embed_class``.
    no_embed_class: bool = False
    # LayerScale (Touvron et al. 2021, CaiT; DeiT III, DINOv2): each residual branch times a learned per-channel
    # gain diag(gamma), initialised to this value; None: none (the paper's Eq. 2-3).
    layer_scale: float | None = None
    # q/k normalisation (Dehghani et al. 2023, ViT-22B): a LayerNorm on each head's queries and keys.
    qk_norm: bool = False
    # Any H x W divisible by the patch, E_pos resampled in 2-D for each input's grid (§3.2; timm's
    # dynamic_img_size=True, which vitkit's models always were). False: only img_size, other sizes refused (timm's
    # default); model.set_input_size rebuilds the model for another size once.
    dynamic_img_size: bool = True
    # The MLPs' GELU: exact (the paper's, timm's, DINOv2's) or its tanh approximation (SigLIP, SigLIP 2).
    mlp_act: str = "gelu"
    # How a learned E_pos is resampled to another grid (§3.2): bicubic (timm's), or bilinear (SigLIP 2's NaFlex).
    pos_interp: str = "bicubic"
    drop_rate: float = 0.0
    pos_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        coerce_fields(self, "ViTConfig")  # types first: "4", 4.0 and [4, 4] are taken as meant; "four", 4.5 are not
        if self.hybrid in ("", "none"):  # `--hybrid none`: a plain ViT even where a recipe has a stem
            object.__setattr__(self, "hybrid", None)
        # Normalise tuples given as lists (YAML / JSON) so configs compare and hash equal.
        for name in ("img_size", "patch_size"):
            v = getattr(self, name)
            if not isinstance(v, int):
                v = to_2tuple(v)
                object.__setattr__(self, name, v[0] if v[0] == v[1] else v)
        for name in ("in_chans", "num_classes", "embed_dim", "depth", "num_heads"):
            if getattr(self, name) < (0 if name == "num_classes" or (name == "depth" and self.hybrid) else 1):
                raise ValueError(f"ViTConfig.{name} must be positive, got {getattr(self, name)}"
                                 + (" (0 only with a hybrid stem: the CNN alone)" if name == "depth" else ""))
        self._check_bounds()
        if self.pool not in POOLS:
            raise ValueError(f"ViTConfig.pool must be one of {POOLS}, got {self.pool!r}")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"ViTConfig.pos_embed must be one of {POS_EMBEDS}, got {self.pos_embed!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ViTConfig.mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        if self.pos_interp not in POS_INTERPS:
            raise ValueError(f"ViTConfig.pos_interp must be one of {POS_INTERPS}, got {self.pos_interp!r}")
        if self.dist_token and (self.pool != "cls" or self.fc_norm):
            raise ValueError("dist_token (DeiT) needs pool='cls' and fc_norm=False: its heads read the class and "
                             f"distillation tokens after the final LayerNorm; got pool={self.pool!r}, "
                             f"fc_norm={self.fc_norm}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.pos_embed == "sincos2d" and self.embed_dim % 4:
            raise ValueError(f"pos_embed='sincos2d' needs embed_dim divisible by 4, got {self.embed_dim}")
        (h, w), (ph, pw), s = to_2tuple(self.img_size), to_2tuple(self.patch_size), self.input_stride
        if h % (ph * s) or w % (pw * s):
            raise ValueError(f"img_size {(h, w)} must be a multiple of the patch size {(ph * s, pw * s)}"
                             + (f" (patch {(ph, pw)} x hybrid stride {s})" if s > 1 else ""))

    def _check_bounds(self) -> None:
        """Sizes a ViT can have, with room to spare (ViT-22B: depth 48, width 6,144): a hostile config.json is
        refused here instead of making vitkit allocate a model first and fail later."""
        for name, hi in (("depth", 1024), ("embed_dim", 65536), ("in_chans", 256), ("num_classes", 1_000_000)):
            check_range("ViTConfig", name, getattr(self, name), hi=hi)
        check_range("ViTConfig", "mlp_ratio", self.mlp_ratio, 0, 64, lo_open=True)
        check_range("ViTConfig", "layer_norm_eps", self.layer_norm_eps, 0, 1, lo_open=True)
        check_range("ViTConfig", "reg_tokens", self.reg_tokens, 0, 256)
        check_range("ViTConfig", "representation_size", self.representation_size, 1, 65536)
        check_range("ViTConfig", "layer_scale", self.layer_scale, 0, 10, lo_open=True)
        for name in ("drop_rate", "pos_drop_rate", "attn_drop_rate", "proj_drop_rate", "drop_path_rate"):
            check_range("ViTConfig", name, getattr(self, name), 0, 1, hi_open=True)
        for side, patch in zip(to_2tuple(self.img_size), to_2tuple(self.patch_size)):
            check_range("ViTConfig", "img_size", side, 1, 16384)
            check_range("ViTConfig", "patch_size", patch, 1, side)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class token, the distillation token, the registers (where present)."""
        return int(self.pool == "cls") + int(self.dist_token) + self.reg_tokens

    @property
    def num_readout_tokens(self) -> int:
        """The leading tokens the head reads: the class token (and the distillation token), or 0 when it reads the
        patches (GAP, MAP)."""
        return int(self.pool == "cls") + int(self.dist_token)

    @property
    def pos_prefix_tokens(self) -> int:
        """Rows of the position table before the patches' rows: none with ``no_embed_class``."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    def after_paper(self) -> list[str]:
        """The additions made after the paper that this config uses, by field name ([] for the paper's ViT)."""
        return [name for name in AFTER_PAPER if getattr(self, name) not in (False, 0, None)]

    def refuse_after_paper(self, fmt: str, pre_logits: bool = False) -> None:
        """Raise, naming them, if this config uses additions ``fmt``'s model class cannot hold, or (unless
        ``fmt`` has a place for it: ``pre_logits``) the pre-training head's hidden layer."""
        if used := self.after_paper():
            raise ValueError(f"{fmt} has no {', '.join(used)} (additions after the paper, in this model): export "
                             "timm, safetensors or onnx instead")
        if not pre_logits:
            self.refuse_pre_logits(fmt)

    def refuse_pre_logits(self, fmt: str) -> None:
        """Raise if this config has the pre-training head's hidden layer, which ``fmt`` has no place for."""
        if self.representation_size:
            raise ValueError(f"{fmt} has no pre-training head's hidden layer (representation_size="
                             f"{self.representation_size}: §3.1's MLP head, Dense + tanh before the classifier): "
                             "export safetensors, onnx or the official npz layout, or fine-tune first (the new head "
                             "replaces it)")

    @property
    def head_width(self) -> int:
        """The classifier's input width: the pre-training head's hidden layer where there is one, else D."""
        return self.representation_size or self.embed_dim

    @property
    def input_stride(self) -> int:
        """Pixels per feature-map cell before patching: 1, or the CNN stride of the hybrid stem."""
        return hybrid_stride(self.hybrid) if self.hybrid else 1

    @property
    def grid_size(self) -> tuple[int, int]:
        """The patch grid (H/P, W/P) at ``img_size``."""
        (h, w), (ph, pw), s = to_2tuple(self.img_size), to_2tuple(self.patch_size), self.input_stride
        return h // (ph * s), w // (pw * s)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def replace(self, **overrides: Any) -> "ViTConfig":
        return dataclasses.replace(self, **check_keys(overrides, "ViTConfig", ViTConfig))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ViTConfig":
        return cls(**check_keys(d, "ViTConfig", cls))


def hybrid_stages(spec: str) -> int:
    """``"resnet50:3"`` -> 3 (stem + 3 ResNet stages); ``"resnetv2:3,4,9"`` -> 3; ``"conv:32,64"`` -> 2 (two 3x3
    convolutions)."""
    name, _, n = spec.partition(":")
    if name == "conv":
        return sum(w != "M" for w in conv_channels(spec))
    if name == "resnetv2":
        return len(resnetv2_layers(spec))
    if not name.startswith("resnet") or not (n or "3").isdigit() or not 1 <= int(n or 3) <= 4:
        raise ValueError(f"hybrid must look like 'resnetv2:3,4,9' (the official GN+WS ResNet: blocks per stage), "
                         f"'resnet50:3' (a torchvision ResNet and 1-4 stages) or 'conv:32,64' "
                         f"(3x3 convolutions with these widths), got {spec!r}")
    return int(n or 3)


def resnetv2_layers(spec: str) -> tuple[int, ...]:
    """``"resnetv2:3,4,9"`` -> (3, 4, 9) bottleneck blocks per stage; ``"resnetv2:"`` -> () (the root alone)."""
    blocks = [b.strip() for b in spec.partition(":")[2].split(",") if b.strip()]
    if not all(b.isdigit() and 1 <= int(b) <= 64 for b in blocks) or len(blocks) > 4:
        raise ValueError(f"hybrid {spec!r}: expected 'resnetv2:' and up to 4 block counts (1-64), such as "
                         "'resnetv2:3,4,9' (R50+ViT-B/16) or 'resnetv2:' (the root alone, R+ViT-Ti/16)")
    return tuple(int(b) for b in blocks)


def conv_channels(spec: str) -> list[int | str]:
    """``"conv:32,64"`` -> [32, 64]; ``"conv:64,M,128,M"`` -> [64, "M", 128, "M"] ("M": 2x2 max-pooling, as in
    torchvision's VGG configurations); ``"conv:64,R64,M,R128"`` -> [64, "R64", "M", "R128"] ("R": a residual
    BasicBlock of torchvision's ResNet with that width)."""
    widths = [w.strip() for w in spec.partition(":")[2].split(",")]

    def ok(w: str) -> bool:
        w = w[1:] if w.startswith("R") else w
        return w.isdigit() and int(w) > 0

    if not all(w == "M" or ok(w) for w in widths) or all(w == "M" for w in widths):
        raise ValueError(f"hybrid {spec!r}: expected 'conv:' and positive widths, optionally with M for 2x2 "
                         "max-pooling and R<width> for a residual block, such as 'conv:32,64', 'conv:64,M,128,M' "
                         "or 'conv:64,R64,M,R128'")
    return [w if w == "M" or w.startswith("R") else int(w) for w in widths]


def hybrid_stride(spec: str) -> int:
    stages = hybrid_stages(spec)  # also validates the spec
    if spec.startswith("conv:"):
        return 2 ** conv_channels(spec).count("M")  # stride-1 convolutions; each max-pooling halves the map
    return 4 * 2 ** max(stages - 1, 0)  # root /4 (conv /2, max-pool /2), then each later stage /2


# Table 1 of the paper: (Layers, Hidden size D, MLP size, Heads). MLP size is always 4·D.
TABLE1: dict[str, dict[str, int]] = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),  # DeiT's Ti, used by timm and AugReg
    "small": dict(embed_dim=384, depth=12, num_heads=6),  # likewise S
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "huge": dict(embed_dim=1280, depth=32, num_heads=16),
}
PATCHES = {"tiny": (8, 16, 32), "small": (8, 16, 32), "base": (8, 16, 32), "large": (14, 16, 32), "huge": (14, 16)}


def _build_presets() -> dict[str, ViTConfig]:
    presets: dict[str, ViTConfig] = {}
    for size, dims in TABLE1.items():
        for p in PATCHES[size]:
            for res in (224, 384) if p != 14 else (224,):
                presets[f"vit_{size}_patch{p}_{res}"] = ViTConfig(img_size=res, patch_size=p, **dims)
    # The paper's hybrid (§3.1): a ResNet-50 feature map (stride 16) cut into 1x1 patches.
    # Named apart from timm's vit_base_r50_s16_* below, whose ResNet is the official one (GroupNorm, weight
    # standardisation, 3-4-9 blocks) rather than torchvision's.
    for res in (224, 384):
        presets[f"vit_base_tvresnet50_s16_{res}"] = ViTConfig(img_size=res, patch_size=1, hybrid="resnet50:3",
                                                               **TABLE1["base"])
    # The official hybrids (vision_transformer's R+ViT-Ti/16, R26+ViT-S/32, R50+ViT-B/16), under timm's names.
    for res in (224, 384):
        presets[f"vit_tiny_r_s16_p8_{res}"] = ViTConfig(img_size=res, patch_size=8, hybrid="resnetv2:",
                                                        **TABLE1["tiny"])
        presets[f"vit_small_r26_s32_{res}"] = ViTConfig(img_size=res, patch_size=1, hybrid="resnetv2:2,2,2,2",
                                                        **TABLE1["small"])
        presets[f"vit_base_r50_s16_{res}"] = ViTConfig(img_size=res, patch_size=1, hybrid="resnetv2:3,4,9",
                                                       **TABLE1["base"])
    # After the paper, under timm's names (docs: "After the paper"): DeiT's distilled models, DeiT III's LayerScale
    # models, DINOv2 with registers (features only: no head), and a no-class-token GAP model with LayerScale.
    for size in ("small", "base"):
        presets[f"deit_{size}_distilled_patch16_224"] = ViTConfig(dist_token=True, **TABLE1[size])
        presets[f"deit3_{size}_patch16_224"] = ViTConfig(no_embed_class=True, layer_scale=1e-6, **TABLE1[size])
        presets[f"vit_{size}_patch14_reg4_dinov2"] = ViTConfig(
            img_size=518, patch_size=14, num_classes=0, reg_tokens=4, no_embed_class=True, layer_scale=1e-5,
            **TABLE1[size])
    presets["vit_medium_patch16_gap_256"] = ViTConfig(img_size=256, embed_dim=512, depth=12, num_heads=8, pool="gap",
                                                      qkv_bias=False, layer_scale=1e-6)
    # Small models for small images (Fashion-MNIST, CIFAR, digits): not in the paper, used by our recipes.
    presets["vit_micro_patch4_32"] = ViTConfig(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4)
    presets["vit_nano_patch2_8"] = ViTConfig(img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=4,
                                             in_chans=1, num_classes=10)
    return presets


PRESETS: dict[str, ViTConfig] = _build_presets()
