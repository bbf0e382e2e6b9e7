"""Attention alone, as ViT-B/16 runs it at batch 16 (12 heads, 197 tokens, head dim 64, bf16): how fast each
PyTorch path and vitkit's AMX kernel (vitkit/runtime/kernels) are, next to the matmul speed of the linear layers
(docs/speed.md).

    python benchmarks/attention_cpu.py [--batch 16] [--repeats 5]

Times per layer (best of the round-robin repeats) and GFLOP/s (4·B·h·T²·d per layer). Not a test: numbers only.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()

B, H, T, D = args.batch, 12, 197, 64
torch.manual_seed(0)
q, k, v = torch.randn(B, T, 3, H, D, dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)  # as Attention.forward cuts qkv
qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()


def exact(q, k, v):  # noqa: ANN001, ANN201
    return torch.softmax((q * D ** -0.5) @ k.transpose(-2, -1), dim=-1) @ v


def math_backend():  # noqa: ANN201
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


padded = {t: torch.randn(3, B, H, t, D, dtype=torch.bfloat16).unbind(0) for t in (208, 224, 256)}
paths = {
    "SDPA (flash kernel), q/k/v strided as in the model": lambda: F.scaled_dot_product_attention(q, k, v),
    "SDPA, contiguous q/k/v": lambda: F.scaled_dot_product_attention(qc, kc, vc),
    "exact: bmm + softmax + bmm": lambda: exact(q, k, v),
    "exact, contiguous q/k/v": lambda: exact(qc, kc, vc),
    "SDPA math backend": math_backend,
    **{f"SDPA, T padded to {t}": (lambda t=t: F.scaled_dot_product_attention(*padded[t])) for t in padded},
}
from vitkit import kernels  # noqa: E402

if kernels.load():
    qkv = torch.stack([q, k, v]).permute(1, 3, 0, 2, 4).contiguous()  # (B, T, 3, H, D): the qkv linear's output
    paths["vitkit's AMX kernel, from the qkv linear's output"] = lambda: kernels.vit_attention(qkv, D ** -0.5)
else:
    print("vitkit's AMX attention kernel not available here (no AMX or no C++ compiler)")
try:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    paths["flex_attention, torch.compile'd"] = lambda: flex(qc, kc, vc)
except Exception as e:  # noqa: BLE001
    print(f"flex_attention not available: {e}")

best: dict[str, float] = {}
with torch.no_grad():
    ref = exact(qc, kc, vc).float()
    for name, f in paths.items():
        f()  # warm-up (and compile)
        if "padded" not in name:
            out = f().float()
            err = (out.transpose(1, 2) if "qkv" in name else out).sub(ref).abs().max().item()
            assert err < 0.05, f"{name}: max abs difference {err} from the exact path"
    for _ in range(args.repeats):
        for name, f in paths.items():
            t0 = time.perf_counter()
            for _ in range(5):
                f()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / 5)
a = torch.randn(3152, 768, dtype=torch.bfloat16)
w = torch.randn(3072, 768, dtype=torch.bfloat16)
F.linear(a, w)
t0 = time.perf_counter()
for _ in range(10):
    F.linear(a, w)
lin = (time.perf_counter() - t0) / 10

print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={B}, heads={H}, T={T}, d={D}, bf16")
for name, s in best.items():
    t = int(name.rsplit(" ", 1)[1]) if "padded" in name else T
    print(f"{name:<52} {s * 1e3:7.2f} ms/layer  {4 * B * H * t * t * D / s / 1e9:6.0f} GFLOP/s")
print(f"{'for scale: the MLP fc1 linear (3152x768 @ 768x3072)':<52} {lin * 1e3:7.2f} ms        "
      f"{2 * 3152 * 768 * 3072 / lin / 1e9:6.0f} GFLOP/s")
