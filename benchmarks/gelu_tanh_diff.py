"""How far the tanh-approximate GELU (used by the official JAX ViT checkpoints) moves a ViT's logits from the exact
GELU that vitkit, timm and Hugging Face use: random weights (a random head too), two images.

    python benchmarks/gelu_tanh_diff.py
"""
import argparse
import copy

import torch

import vitkit
from vitkit.model.vit import Mlp

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
torch.manual_seed(0)
for name in ("vit_tiny_patch16_224", "vit_base_patch16_224"):
    m = vitkit.create_model(name).eval()
    torch.nn.init.normal_(m.head.weight, std=0.02)  # presets start with a zero head
    t = copy.deepcopy(m)
    for mod in t.modules():
        if isinstance(mod, Mlp):
            mod.act = torch.nn.GELU(approximate="tanh")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        a, b = m(x), t(x)
    print(f"{name}: max |logit difference| {(a - b).abs().max().item():.2e}, max |logit| {a.abs().max().item():.2e}")
