"""What ``vitkit push`` writes beside the weights: timm's Hub config (so ``timm.create_model("hf-hub:USER/NAME",
pretrained=True)`` builds the same network) and the model card, a ``README.md`` whose YAML header is the Hub's
metadata (written by huggingface_hub's own ``ModelCardData``: tags, pipeline, the metric in ``model-index``) and
whose text says what the model is, how it was trained, what it measured and how to load it with vitkit, timm and
transformers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub import EvalResult, ModelCardData

from ..model.config import ViTConfig, to_2tuple
from ..model.vit import VisionTransformer

# Hugging Face Hub datasets for the datasets vitkit reads by name (the card's `datasets:` links to them)
HUB_DATASETS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100", "mnist": "ylecun/mnist",
                "fashion-mnist": "zalando-datasets/fashion_mnist"}
# A registered timm architecture whose builder takes every field below as a keyword (timm's `model_args`
# override its defaults): the network is the one `model_args` describe, whatever the name's own sizes
TIMM_ARCH = "vit_base_patch16_224"


def timm_refusal(c: ViTConfig) -> str | None:
    """Why timm's ``VisionTransformer`` cannot be built as ``c`` from a config file alone, or None where it can."""
    if c.hybrid:
        return f"a hybrid stem ({c.hybrid})"
    if c.representation_size:
        return "the pre-training head's hidden layer (representation_size)"
    if c.pos_embed != "learn":
        return f"pos_embed={c.pos_embed!r} (timm's has a learned table only)"
    if c.dist_token:
        return "a distillation token (timm's VisionTransformerDistilled is another class)"
    if c.layer_norm_eps != 1e-6 or c.mlp_act != "gelu":
        return (f"layer_norm_eps={c.layer_norm_eps:g}, mlp_act={c.mlp_act!r} (a config file sets neither in timm: "
                "1e-6 and exact GELU only)")
    if c.pool == "map":
        return "attention pooling ('map'), whose head timm names differently"
    return None


def timm_hub_config(c: ViTConfig, pre: dict[str, Any]) -> dict[str, Any]:
    """timm's Hub ``config.json`` fields for ``c`` (``timm.models.load_model_config_from_hf`` reads them)."""
    h, w = to_2tuple(c.img_size)
    args = dict(img_size=[h, w], patch_size=list(to_2tuple(c.patch_size)), in_chans=c.in_chans,
                num_classes=c.num_classes, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
                mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, class_token=c.pool == "cls",
                global_pool={"cls": "token", "gap": "avg"}[c.pool], fc_norm=c.fc_norm,
                no_embed_class=c.no_embed_class, reg_tokens=c.reg_tokens, init_values=c.layer_scale,
                qk_norm=c.qk_norm)
    interpolation = pre.get("interpolation", "bicubic")
    return {"architecture": TIMM_ARCH, "num_classes": c.num_classes, "num_features": c.embed_dim,
            "global_pool": args["global_pool"], "model_args": args,
            **({"label_names": list(pre["class_names"])} if pre.get("class_names") else {}),
            "pretrained_cfg": {"input_size": [c.in_chans, h, w], "mean": list(pre["mean"]), "std": list(pre["std"]),
                               "crop_pct": pre.get("crop_pct", 1.0), "crop_mode": pre.get("crop_mode", "center"),
                               "interpolation": interpolation, "num_classes": c.num_classes, "classifier": "head"}}


@dataclass
class RunFacts:
    """What a run folder says about how its weights came to be (each part absent where the folder lacks it)."""

    config: dict[str, Any] = field(default_factory=dict)  # config.yaml
    plan: dict[str, Any] = field(default_factory=dict)  # plan.json
    best: dict[str, Any] = field(default_factory=dict)  # metrics.jsonl's line of the best val_top1
    last: dict[str, Any] = field(default_factory=dict)  # ... and its last line
    evaluated: dict[str, Any] = field(default_factory=dict)  # CHECKPOINT/eval/eval.json (`vitkit eval`)
    which: str = "best"  # best/ or last/
    curves: bool = False  # curves.png goes with it


def _params(c: ViTConfig) -> str:
    with torch.device("meta"):  # counted without allocating
        n = sum(p.numel() for p in VisionTransformer(c).parameters())
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


def _metric_rows(f: RunFacts) -> list[str]:
    """The pushed weights' epoch, and the run's last epoch where that is another one."""
    shown = [("the checkpoint's epoch" if f.which == "best" else "the last epoch", f.best)]
    if f.last is not f.best:
        shown.append(("the run's last epoch", f.last))
    return [f"| {what} ({m.get('epoch', '?')}, step {m.get('step', '?')}) | {_pct(m['val_top1'])} | "
            f"{_pct(m.get('val_top5'))} | {_num(m.get('val_loss'), '.4f')} |"
            for what, m in shown if m.get("val_top1") is not None]


def _validation_words(f: RunFacts) -> str:
    share = f.config.get("holdout") or 0
    if share:
        return (f"{share:g} of the training images held out (`--holdout {share:g}`); the test split was not used "
                "to choose anything")
    return "the dataset's own evaluation split (the one `vitkit train` validates on: its test or validation images)"


def model_card(repo_id: str, model: Any, pre: dict[str, Any], facts: RunFacts, files: dict[str, str],
               timm_why_not: str | None, hf_why_not: str | None) -> str:
    """The ``README.md`` of a pushed model: Hub metadata (YAML) and the card's text."""
    c: ViTConfig = model.config
    dataset = str(facts.config.get("dataset") or "unknown")
    m = facts.best  # (the last epoch's with --which last: run_facts)
    results = []
    if m.get("val_top1") is not None:
        results.append(EvalResult(task_type="image-classification", dataset_type=HUB_DATASETS.get(dataset, dataset),
                                  dataset_name=str(dataset), dataset_split="validation", metric_type="accuracy",
                                  metric_name="top-1 accuracy", metric_value=round(float(m["val_top1"]), 3)))
    data = ModelCardData(library_name="vitkit", pipeline_tag="image-classification", model_name=repo_id,
                         tags=["vitkit", "vision-transformer", "image-classification"]
                         + (["timm"] if not timm_why_not else []) + (["transformers"] if not hf_why_not else []),
                         datasets=[HUB_DATASETS[dataset]] if dataset in HUB_DATASETS else None,
                         metrics=["accuracy"] if results else None, eval_results=results or None)
    h, w = to_2tuple(c.img_size)
    name = repo_id.split("/")[-1]
    cfg = facts.config
    lines = [f"---\n{data.to_yaml()}\n---", "", f"# {name}", "",
             f"A Vision Transformer (Dosovitskiy et al., \"An Image is Worth 16x16 Words\", ICLR 2021) "
             f"{'trained on ' + str(dataset) + ' ' if dataset != 'unknown' else ''}with vitkit, and pushed by "
             "`vitkit push`.", "",
             "## The model", "",
             "| | |", "|---|---|",
             f"| model | `{cfg.get('model') or 'custom'}` ({_params(c)} parameters) |",
             f"| image size | {h}x{w}, {c.in_chans} channel{'s' if c.in_chans > 1 else ''} |",
             f"| patches | {'x'.join(map(str, to_2tuple(c.patch_size)))} ({c.grid_size[0] * c.grid_size[1]} an image) |",
             f"| width, depth, heads | {c.embed_dim}, {c.depth}, {c.num_heads} (MLP x{c.mlp_ratio:g}) |",
             f"| pooling | {c.pool} |",
             f"| classes | {c.num_classes}"
             + (f": {', '.join(map(str, pre['class_names'][:20]))}{' ...' if len(pre['class_names']) > 20 else ''}"
                if pre.get("class_names") else "") + " |",
             f"| input | resized to {h}x{w}, scaled to [0, 1], normalised by mean {_nums(pre['mean'])} and std "
             f"{_nums(pre['std'])} |"]
    if after := c.after_paper():
        lines.append(f"| after the paper | {', '.join(after)} |")
    if cfg:
        lines += ["", "## Training", "", "| | |", "|---|---|"]
        for key, label in (("dataset", "dataset"), ("data_dir", "data"), ("recipe", "recipe"),
                           ("init", "started from"), ("train_fraction", "share of the labels"),
                           ("semi", "semi-supervised"), ("epochs", "epochs (asked)"), ("time_limit", "time limit"),
                           ("batch_size", "batch"), ("opt", "optimizer"), ("lr", "learning rate"),
                           ("weight_decay", "weight decay"), ("seed", "seed")):
            v = cfg.get(key)
            if v is None or (key == "train_fraction" and v == 1.0):
                continue
            lines.append(f"| {label} | {_minutes(v) if key == 'time_limit' else v} |")
        if facts.last:
            lines.append(f"| ran | {facts.last.get('epoch', '?')} epochs, {facts.last.get('step', '?')} steps, "
                         f"{_num(facts.last.get('elapsed_s'), '.0f')} s |")
        plan = facts.plan
        if isinstance(plan.get("chosen"), dict):
            chosen = ", ".join(f"{k} {v}" for k, v in plan["chosen"].items())
            lines.append(f"| machine | {plan.get('machine', '?')} on {plan.get('device', '?')}: {chosen} |")
        lines += ["", "The run's whole configuration is `training/config.yaml` in this repository: `vitkit train "
                  "--config training/config.yaml --output NEW_FOLDER` runs it again (its `data_dir`, if any, is a "
                  "path on the machine that trained it)."]
    rows = _metric_rows(facts)
    if rows:
        lines += ["", "## Results", "", f"Measured on {_validation_words(facts)}.", "",
                  "| weights | top-1 | top-5 | loss |", "|---|---|---|---|", *rows]
    if ev := facts.evaluated:
        lines += ["", f"`vitkit eval` on {ev.get('dataset', '?')}'s {ev.get('split', '?')} split: top-1 "
                      f"{_pct(ev.get('top1'))}, top-5 {_pct(ev.get('top5'))}."]
    if facts.curves:
        lines += ["", "![training curves](curves.png)"]
    lines += ["", "## Use it", "", "With vitkit (`pip install vitkit`):", "", "```bash",
              f"vitkit predict --checkpoint hf-hub:{repo_id} photo.jpg", "```", "", "```python", "import vitkit", "",
              f"model = vitkit.load(\"hf-hub:{repo_id}\").eval()  # its preprocessing: model.preprocessing", "```"]
    if timm_why_not:
        lines += ["", f"timm: no equivalent ({timm_why_not})."]
    else:
        lines += ["", "With timm (the same weights, the same logits):", "", "```python", "import timm", "",
                  f"model = timm.create_model(\"hf-hub:{repo_id}\", pretrained=True).eval()", "```"]
    if hf_why_not:
        lines += ["", f"transformers: no equivalent ({hf_why_not})."]
    else:
        lines += ["", "With transformers (the `hf/` folder):", "", "```python",
                  "from transformers import AutoImageProcessor, ViTForImageClassification", "",
                  f"processor = AutoImageProcessor.from_pretrained(\"{repo_id}\", subfolder=\"hf\")",
                  f"model = ViTForImageClassification.from_pretrained(\"{repo_id}\", subfolder=\"hf\").eval()", "```"]
    lines += ["", "## Files", "", "| file | what |", "|---|---|",
              *(f"| `{path}` | {what} |" for path, what in files.items()), ""]
    return "\n".join(lines)


def _nums(xs: Any) -> str:
    return "(" + ", ".join(f"{x:.4g}" for x in xs) + ")"


def _num(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def _pct(x: Any) -> str:
    return f"{_num(x, '.2f')}%"


def _minutes(v: Any) -> str:
    return f"{v:g} min" if isinstance(v, (int, float)) else str(v)
