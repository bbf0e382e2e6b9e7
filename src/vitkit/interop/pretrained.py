"""``create_model(name, pretrained=...)``: a preset, or weights from the registry, the Hub, a URL or a local path,
loaded through the one loader and carrying the preprocessing they were trained with."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..model.config import PRESETS
from ..model.registry import create_model as create_preset
from ..model.vit import VisionTransformer
from .download import download_url, hub_file, resolve  # noqa: F401 - resolve: here too, as before
from .load import load
from .registry import PRETRAINED, Pretrained, get_pretrained

LABEL_FILES = {"imagenet-1k": "imagenet1k_labels.txt"}
ARCH_KEYS = ("patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "pool",
             "pos_embed", "fc_norm", "representation_size", "hybrid", "dist_token", "reg_tokens", "no_embed_class",
             "layer_scale", "qk_norm")


def _arch(c: Any, key: str) -> Any:
    """The part of a config field that makes the architecture: LayerScale's presence, not its starting value."""
    v = getattr(c, key)
    return v is not None if key == "layer_scale" else v


def class_names(labels: str | None, num_classes: int) -> list[str] | None:
    """The names of a label set that ships with vitkit (ImageNet-1k), when the head has that many classes."""
    if labels not in LABEL_FILES:
        return None
    names = (Path(__file__).parent / LABEL_FILES[labels]).read_text().splitlines()
    return names if len(names) == num_classes else None


def fetch(entry: Pretrained, revision: str | None = None, progress: bool = True) -> Path:
    """The local file (or, for Hugging Face repos, folder) of a registry entry."""
    if entry.hub:
        path = hub_file(entry.hub, entry.filename, revision)
        if entry.fmt == "hf":
            hub_file(entry.hub, "config.json", revision)  # beside the weights in the same snapshot folder
            return path.parent
        return path
    return download_url(str(entry.url), entry.filename, entry.sha256, progress=progress)


def check_arch(model: VisionTransformer, arch: str, source: str) -> None:
    """The weights are the architecture the name promises (never a silently different model under its name)."""
    want = PRESETS[arch]
    diff = {k: (_arch(want, k), _arch(model.config, k)) for k in ARCH_KEYS
            if _arch(want, k) != _arch(model.config, k)}
    if diff:
        raise ValueError(f"{source}: the weights are not a {arch}: " + ", ".join(
            f"{k} {theirs!r} where {arch} has {ours!r}" for k, (ours, theirs) in diff.items()))


def load_pretrained_entry(entry: Pretrained, revision: str | None = None, progress: bool = True,
                          **overrides: Any) -> VisionTransformer:
    path = fetch(entry, revision, progress)
    model = load(path, entry.fmt, architecture=entry.arch, **overrides)
    check_arch(model, entry.arch, entry.source)
    return with_preprocessing(model, entry, source=entry.name,
                              class_names=class_names(entry.labels, model.config.num_classes))


def with_preprocessing(model: VisionTransformer, entry: Pretrained, **extra: Any) -> VisionTransformer:
    """``model`` carrying the entry's evaluation preprocessing (what save_pretrained and predict read)."""
    model.preprocessing = {**getattr(model, "preprocessing", {}), **entry.preprocessing(), **extra,
                           "img_size": model.config.to_dict()["img_size"]}
    return model


def create_model(name: str, pretrained: bool | str = False, revision: str | None = None, progress: bool = True,
                 **overrides: Any) -> VisionTransformer:
    """A model by name: a preset (``vit_base_patch16_224``) or registered weights (``vit_base_patch16_224.augreg2_
    in21k_ft_in1k``, ``google/vit-base-patch16-224``, ``jax/imagenet21k/ViT-B_16``).

    ``pretrained=True`` loads the registered weights (a bare preset name takes its first entry, as timm does);
    ``pretrained="hf-hub:ORG/REPO"``, a Hub id, a URL or a local file/folder loads those instead (and they must be
    the named architecture). ``num_classes`` starts a new zero head, ``img_size`` resamples the position
    embeddings (§3.2). Hub files come through huggingface_hub (``HF_HOME``, ``HF_HUB_OFFLINE``, tokens), URLs
    into torch.hub's cache; weights are safetensors, npz or ``weights_only`` loads, never pickles."""
    if isinstance(pretrained, str):
        path, fmt = resolve(pretrained, revision, progress)
        arch = name if name in PRESETS else get_pretrained(name).arch
        model = load(path, fmt, architecture=arch, **overrides)
        check_arch(model, arch, pretrained)
        return model
    if pretrained:
        return load_pretrained_entry(get_pretrained(name), revision, progress, **overrides)
    if name not in PRETRAINED:  # a preset, or an unknown name (the error lists close preset names)
        return create_preset(name, **overrides)
    entry = PRETRAINED[name]  # a tag without its weights: the architecture, the entry's head and preprocessing
    return with_preprocessing(create_preset(entry.arch, **{"num_classes": entry.num_classes, **overrides}), entry)


def load_init(source: str, **overrides: Any) -> VisionTransformer:
    """Weights to fine-tune (``vitkit train --init``): a registered NAME.TAG, a Hub id, a URL or a local path."""
    if source in PRETRAINED or (not Path(source).exists() and source in PRESETS):
        return load_pretrained_entry(get_pretrained(source), **overrides)
    path, fmt = resolve(source)
    return load(path, fmt, **overrides)


def init_image_size(source: str) -> int | tuple[int, int]:
    """The image size weights were trained at, without loading them (224 where only loading would tell)."""
    if source in PRETRAINED:
        return PRETRAINED[source].img_size
    meta = _folder_config(source)
    size = (meta.get("model") or {}).get("img_size") or meta.get("image_size") or 224
    return size if isinstance(size, int) else tuple(size)


def init_preprocessing(source: str) -> dict[str, Any]:
    """The preprocessing weights carry (their publisher's mean, std, resize and crop), without loading them: a
    registered NAME.TAG's, or a vitkit folder's config.json; {} where only loading would tell."""
    if source in PRETRAINED or (not Path(source).exists() and source in PRESETS):
        return get_pretrained(source).preprocessing()
    pre = _folder_config(source).get("preprocessing")
    return pre if isinstance(pre, dict) else {}


def _folder_config(source: str) -> dict[str, Any]:
    p = Path(source) / "config.json"
    try:
        meta = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        return {}  # loading the weights names what is wrong with the file
    return meta if isinstance(meta, dict) else {}
