"""Do registers change a small ViT's tokens? Darcet et al. (2024) find, in large ViTs trained long, a few background
patch tokens whose output norm is far above the rest (their Fig. 3: ~10x) and which the class token attends to; with
registers those norms go away. This trains the same plain ViT on Fashion-MNIST with 0 and 4 registers for the same
time and measures, over 512 test images, the last block's output token norms (before the final LayerNorm, as the
paper measures them) and how much of the class token's last-layer attention its two most-attended patches hold.

    python benchmarks/register_artefacts.py --minutes 4 --out results/register-artefacts.csv

Writes one row per model; prints it too. The two trainings run one after the other (never at once).
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import torch
from _helpers import cpu_label

import vitkit
from vitkit.data.datasets import load_dataset
from vitkit.data.preprocess import normalizer, preprocessing_of
from vitkit.model.vit import record_attention

MODEL = ["--dataset", "fashion-mnist", "--hybrid", "none", "--patch-size", "4", "--embed-dim", "128", "--depth", "6",
         "--num-heads", "4", "--img-size", "28"]


@torch.no_grad()
def measure(model: vitkit.VisionTransformer, x: torch.Tensor) -> dict[str, float]:
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with record_attention(model) as attns:
        logits = model(x)
    hook.remove()
    n0 = model.num_prefix_tokens
    norms = seen[0].norm(dim=-1)  # (B, T): the last block's output, before the final LayerNorm
    patch = norms[:, n0:]
    median = patch.median()
    cls_attn = attns[-1][:, :, 0, n0:].mean(1)  # (B, N): the class token's last-layer attention to the patches
    top2 = cls_attn.topk(2, dim=-1).values.sum(-1) / cls_attn.sum(-1)
    assert torch.isfinite(logits).all()
    return {"patch_norm_median": round(float(median), 2), "patch_norm_max": round(float(patch.max()), 2),
            "max_over_median": round(float(patch.max() / median), 3),
            "share_over_3x_median": round(float((patch > 3 * median).float().mean()), 4),
            "register_norm_mean": round(float(norms[:, 1:n0].mean()), 2) if n0 > 1 else "",
            "cls_top2_patch_attention": round(float(top2.mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--runs", default="runs/registers")
    ap.add_argument("--out", default="results/register-artefacts.csv")
    args = ap.parse_args()
    rows = []
    data = load_dataset("fashion-mnist")
    for regs in (0, 4):
        out = Path(args.runs) / f"reg{regs}"
        r = subprocess.run([sys.executable, "-m", "vitkit", "train", *MODEL, "--reg-tokens", str(regs),
                            "--time-limit", str(args.minutes), "--output", str(out)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        model = vitkit.from_pretrained(out / "best").eval()
        g = torch.Generator().manual_seed(0)
        idx = torch.randperm(len(data.val), generator=g)[:512]
        x = normalizer(preprocessing_of(model), model.config).normalize(data.val.images[idx])
        row = {"registers": regs, "minutes": args.minutes, "epochs": last["epoch"], "steps": last["step"],
               "val_top1": last["val_top1"], **measure(model, x), "cpu": cpu_label(),
               "command": f"python benchmarks/register_artefacts.py --minutes {args.minutes:g}"}
        print(row)
        rows.append(row)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
