"""The Vision Transformer of Dosovitskiy et al. (ICLR 2021), read top-down as the paper's equations 1-4.

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos                     (Eq. 1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                                     (Eq. 2)
    z_l = MLP(LN(z'_l)) + z'_l                                            (Eq. 3)
    y = LN(z_L^0)                                                         (Eq. 4)

Parameter names follow timm's ``VisionTransformer`` so state dicts move between the two unchanged. The additions
made after the paper (distillation and register tokens, LayerScale, q/k normalisation: see ViTConfig) are optional
parts, absent unless the config turns them on.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

from .backbone import Backbone
from .config import ViTConfig, to_2tuple
from .hybrid import cnn_stem
from .masked_stem import masked_features
from .naflex import NaFlexBatch
from .posembed import interpolate_grid, resample_pos_embed, sincos_2d_pos_embed
from .serialization import save_pretrained


# The classifier heads (zero-initialised, replaced on fine-tuning, the only layers a linear probe trains).
HEADS = ("head", "head_dist")

# Attention implementations besides the two below, by name: (qkv (B, T, 3, h, D_h), scale) -> (B, T, h, D_h), for
# inference only, with the head sizes D_h each takes (vitkit ships none: a hook for users' own kernels).
ATTENTION_KERNELS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {}
_TAKES_HEAD_SIZE: dict[str, Callable[[int], bool]] = {}


def register_attention(name: str, kernel: Callable[[torch.Tensor, float], torch.Tensor],
                       takes_head_size: Callable[[int], bool] = lambda d: True) -> None:
    """Make ``kernel`` selectable as ``model.set_attention(name)`` for layers whose head size it takes."""
    ATTENTION_KERNELS[name] = kernel
    _TAKES_HEAD_SIZE[name] = takes_head_size


class Attention(nn.Module):
    """Multi-head self-attention (MSA, Appendix A): softmax(q k^T / sqrt(D_h)) v for each head, then a projection.

    ``impl`` chooses how softmax(q k^T / sqrt(D_h)) v is computed, never what: ``"sdpa"`` (PyTorch's fused
    F.scaled_dot_product_attention), ``"exact"`` (the formula as written, through the ``attend`` softmax module, so
    the attention probabilities can be observed: see ``record_attention``), or a registered kernel (inference only;
    training falls back to SDPA). Set it with ``set_attention``."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attn_drop: float, proj_drop: float,
                 qk_norm: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = (dim // num_heads) ** -0.5  # 1/sqrt(D_h), applied *before* the softmax
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        if qk_norm:  # ViT-22B (Dehghani et al. 2023): q and k LayerNorm-ed per head, keeping the logits bounded
            self.q_norm = nn.LayerNorm(dim // num_heads, eps=eps)
            self.k_norm = nn.LayerNorm(dim // num_heads, eps=eps)
        self.attend = nn.Softmax(dim=-1)  # a module, so record_attention can observe its output
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.impl = "sdpa"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (B, 1, 1, T), True where a key may be attended to: NaFlex batches hide their padding with it."""
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, D // self.num_heads)  # b t (3 h d) -> b t 3 h d
        if hasattr(self, "q_norm"):
            q, k, v = qkv.unbind(2)
            qkv = torch.stack([self.q_norm(q), self.k_norm(k), v], dim=2)
        if self.impl in ATTENTION_KERNELS and not self.training and mask is None:
            x = ATTENTION_KERNELS[self.impl](qkv, self.scale)  # (B, T, h, D_h)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # b t 3 h d -> 3 b h t d
            if self.impl == "exact":
                logits = (q * self.scale) @ k.transpose(-2, -1)
                if mask is not None:
                    logits = logits.masked_fill(~mask, float("-inf"))
                x = self.attn_drop(self.attend(logits)) @ v  # attend: (B, h, T, T)
            else:
                x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                   dropout_p=self.attn_drop.p if self.training else 0.0)
            x = x.transpose(1, 2)  # b h t d -> b t h d
        return self.proj_drop(self.proj(x.reshape(B, T, D)))  # b t h d -> b t (h d)


def set_attention(model: nn.Module, impl: str) -> int:
    """Every Attention in ``model`` computes with ``impl`` (``"sdpa"``, ``"exact"`` or a registered kernel, on the
    layers whose head size it takes; the others keep their own). Returns how many modules were set."""
    known = ("sdpa", "exact", *ATTENTION_KERNELS)
    if impl not in known:
        raise ValueError(f"attention implementation {impl!r} is not available here; expected one of {known}")
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if impl in ATTENTION_KERNELS:
        attns = [m for m in attns if _TAKES_HEAD_SIZE[impl](m.head_dim)]
    for m in attns:
        m.impl = impl
    return len(attns)


_RECORDING = threading.Lock()


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the attention probabilities of every layer, (B, h, T, T) each, of the forward passes this thread
    runs inside: the layers compute on the exact path meanwhile (hooks on their ``attend`` softmax), then go back to
    their own. Threads may record on one model at once (a server's workers): each gets its own maps, and the layers
    go back to their own path when the last recording ends."""
    maps: list[torch.Tensor] = []
    me = threading.get_ident()
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    with _RECORDING:
        for m in attns:
            if getattr(m, "_recorders", 0) == 0:
                m._impl_before_recording = m.impl
                m.impl = "exact"
            m._recorders = getattr(m, "_recorders", 0) + 1
    hooks = [m.attend.register_forward_hook(lambda _m, _i, out: maps.append(out) if threading.get_ident() == me
                                            else None) for m in attns]
    try:
        yield maps
    finally:
        for h in hooks:
            h.remove()
        with _RECORDING:
            for m in attns:
                m._recorders -= 1
                if m._recorders == 0:
                    m.impl = m._impl_before_recording


class Mlp(nn.Module):
    """Two layers with a GELU non-linearity (§3.1)."""

    def __init__(self, dim: int, hidden: int, drop: float, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")  # SigLIP's MLPs use the tanh form
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class AttentionPool(nn.Module):
    """Multihead attention pooling (MAP: big_vision's ``MAPHead``, SigLIP's pooling; timm's ``AttentionPoolLatent``
    names): a learned probe attends over all tokens, then a pre-norm MLP with a residual, as in the encoder."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, c.embed_dim))  # the probe: the one query
        self.q = nn.Linear(c.embed_dim, c.embed_dim)
        self.kv = nn.Linear(c.embed_dim, 2 * c.embed_dim)
        self.proj = nn.Linear(c.embed_dim, c.embed_dim)
        self.norm = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps)
        self.mlp = Mlp(c.embed_dim, int(c.embed_dim * c.mlp_ratio), 0.0, c.mlp_act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        h = self.num_heads
        q = self.q(self.latent).expand(B, -1, -1).reshape(B, 1, h, D // h).transpose(1, 2)  # b 1 (h d) -> b h 1 d
        k, v = self.kv(x).reshape(B, T, 2, h, D // h).permute(2, 0, 3, 1, 4)  # b t (2 h d) -> 2 b h t d
        x = self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, 1, D))
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class DropPath(nn.Module):
    """Stochastic depth: drop the residual branch per sample, rescaling the kept ones."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class LayerScale(nn.Module):
    """CaiT's LayerScale (Touvron et al. 2021): a residual branch multiplied by diag(gamma), learned per channel and
    started small, so each block begins close to the identity."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """One encoder layer: pre-norm MSA and pre-norm MLP, each with a residual connection (Eq. 2-3); with
    ``layer_scale``, each branch is scaled by its LayerScale ``ls1`` / ``ls2`` before it is added."""

    def __init__(self, c: ViTConfig, drop_path: float) -> None:
        super().__init__()
        scale = (lambda: LayerScale(c.embed_dim, c.layer_scale)) if c.layer_scale else nn.Identity
        self.norm1 = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps)
        self.attn = Attention(c.embed_dim, c.num_heads, c.qkv_bias, c.attn_drop_rate, c.proj_drop_rate, c.qk_norm,
                              c.layer_norm_eps)
        self.ls1 = scale()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps)
        self.mlp = Mlp(c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.proj_drop_rate, c.mlp_act)
        self.ls2 = scale()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), mask)))  # Eq. 2: z'_l = MSA(LN(z_{l-1})) + z_{l-1}
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))  # Eq. 3: z_l = MLP(LN(z'_l)) + z'_l
        return x


class PatchEmbed(nn.Module):
    """x_p E of Eq. 1: the image cut into N patches x_p of P*P*C values, each mapped by E to D dimensions. E is held
    as the weight of a P x P convolution with stride P (the same map; timm's, Hugging Face's and the JAX checkpoints'
    layout). In the hybrid model (§3.1) the patches are cut from a CNN feature map instead of the image."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.patch_size = to_2tuple(c.patch_size)
        chans, self.stride = c.in_chans, 1
        if c.hybrid:
            self.backbone, chans, self.stride = cnn_stem(c.hybrid, c.in_chans)
        self.proj = nn.Conv2d(chans, c.embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.in_chans = c.in_chans
        self.grid_size = c.grid_size
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    @property
    def cell(self) -> tuple[int, int]:
        """The pixels one patch covers, (H, W): the patch size, times the CNN's stride in a hybrid."""
        return self.patch_size[0] * self.stride, self.patch_size[1] * self.stride

    def grid_for(self, hw: tuple[int, int]) -> tuple[int, int]:
        """Patch grid for an (H, W) image; raises if the image does not tile into patches."""
        ph, pw = self.cell
        if hw[0] % ph or hw[1] % pw:
            raise ValueError(f"image size {tuple(hw)} is not a multiple of the patch size {(ph, pw)}")
        return hw[0] // ph, hw[1] // pw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "backbone"):
            if x.device.type == "cpu":  # oneDNN's convolutions run faster on channels-last activations
                x = x.contiguous(memory_format=torch.channels_last)
            x = self.backbone(x)
        return self.tokens(x)

    def masked(self, x: torch.Tensor, visible: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x_p E of images of which only the ``visible`` (B, N) patches are seen (masked pre-training): a plain
        ViT's patches are cut from the pixels one by one, and a hybrid's CNN runs with the hidden cells masked at
        every layer (model/masked_stem.py: otherwise its receptive field shows each token its neighbours)."""
        if not hasattr(self, "backbone"):
            return self(x)
        return self.tokens(masked_features(self.backbone, x, visible, grid, self.cell))

    def visible_cells(self, x: torch.Tensor, keep: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x_p E of the ``keep`` (B, K) patches alone, (B, K, D), in that order (MAE's encoder input). A hybrid's
        CNN runs on each kept cell cut out of the image by itself, zero-padded at its borders: a quarter of the
        pixels at MAE's 75% masking, and none of a hidden cell's (model/masked_stem.py: why this, not the whole
        image with every layer masked)."""
        if not hasattr(self, "backbone"):
            tokens = self(x)
            return torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
        (ph, pw), (gh, gw) = self.cell, grid
        b, c, k = x.shape[0], x.shape[1], keep.shape[1]
        cells = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c, ph, pw)
        cells = torch.gather(cells, 1, keep[:, :, None, None, None].expand(-1, -1, c, ph, pw))  # (B, K, C, ph, pw)
        cells = cells.reshape(b * k, c, ph, pw)
        if x.device.type == "cpu":  # oneDNN's convolutions run faster on channels-last activations (as forward)
            cells = cells.contiguous(memory_format=torch.channels_last)
        return self.tokens(self.backbone(cells)).reshape(b, k, -1)  # each cell one token of a 1x1 grid

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A feature map (the image, or a hybrid's CNN map) (B, C, H, W) -> x_p E (B, N, D)."""
        b, c, h, w = x.shape
        (p, q), (gh, gw) = self.patch_size, (h // self.patch_size[0], w // self.patch_size[1])
        # x_p flattened as (P, P, C), and E to match: channels last, as the CNN feature map is laid out on a CPU.
        x_p = x.permute(0, 2, 3, 1).reshape(b, gh, p, gw, q, c).transpose(2, 3).reshape(b, gh * gw, p * q * c)
        return self.project(x_p)

    def project(self, x_p: torch.Tensor) -> torch.Tensor:
        """x_p E for patches flattened as (P, P, C): (B, N, P*P*C) -> (B, N, D)."""
        E = self.proj.weight.permute(0, 2, 3, 1).flatten(1)  # d c p q -> d (p q c)
        # One matmul, not the convolution: the same numbers, and a faster training step on a CPU (docs/speed.md).
        return F.linear(x_p, E, self.proj.bias)


class Blocks(nn.Sequential):
    """The encoder's L blocks in order. With ``checkpointing`` (``VisionTransformer.set_grad_checkpointing``, timm's
    name), each block keeps only its input for the backward pass and runs again there to rebuild what it needs
    (activation checkpointing, Chen et al. 2016): a block's activations held one at a time instead of all L, for one
    more forward of every block (ViT-S/16 at batch 16 on the CPU: the step's memory 922 -> 183 MiB,
    benchmarks/grad_checkpointing.py). Random draws inside a block (drop path, dropout) are replayed
    alike (torch.utils.checkpoint keeps the RNG state)."""

    checkpointing = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        for blk in self:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, mask, use_reentrant=False)
            else:
                x = blk(x, mask)
        return x


class VisionTransformer(Backbone, nn.Module):
    """ViT (Dosovitskiy et al., 2021). ``forward`` gives logits; ``forward_attention`` also every layer's attention."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = self.config = config
        self.num_prefix_tokens = c.num_prefix_tokens  # class, distillation and register tokens
        self.num_readout_tokens = c.num_readout_tokens  # of those, the ones the head reads
        self.patch_embed = PatchEmbed(c)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.pool == "cls" else None
        if c.dist_token:
            self.dist_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim))
        if c.reg_tokens:
            self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, c.embed_dim))
        num_tokens = c.pos_prefix_tokens + self.patch_embed.num_patches
        if c.pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, c.embed_dim))
        elif c.pos_embed == "sincos2d":
            self.register_buffer("pos_embed", self._sincos(self.patch_embed.grid_size), persistent=False)
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(c.pos_drop_rate)
        dpr = [c.drop_path_rate * i / max(c.depth - 1, 1) for i in range(c.depth)]  # grows linearly with depth
        self.blocks = Blocks(*[Block(c, dpr[i]) for i in range(c.depth)])
        self.norm = nn.Identity() if c.fc_norm else nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps)
        self.attn_pool = AttentionPool(c) if c.pool == "map" else None
        self.fc_norm = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps) if c.fc_norm else nn.Identity()
        # §3.1's pre-training head: one hidden layer (Dense + tanh) before the classifier, where configured
        self.pre_logits = nn.Sequential(OrderedDict(fc=nn.Linear(c.embed_dim, c.representation_size), act=nn.Tanh())) \
            if c.representation_size else None
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(c.head_width, c.num_classes) if c.num_classes > 0 else nn.Identity()
        if c.dist_token:
            self.head_dist = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.init_weights()

    def _sincos(self, grid: tuple[int, int]) -> torch.Tensor:
        return sincos_2d_pos_embed(grid, self.config.embed_dim, self.config.pos_prefix_tokens)

    def prefix_tokens(self) -> list[torch.Tensor]:
        """The learned tokens before the patches, in order: class, distillation, registers (each (1, n, D))."""
        return [t for t in (self.cls_token, getattr(self, "dist_token", None), getattr(self, "reg_token", None))
                if t is not None]

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the official implementation: Xavier-uniform linears, zero head, N(0, 0.02) position embedding and
        class token (truncated at 2 sigma), the patch embedding initialised as the linear layer it is."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name in HEADS:
                    nn.init.zeros_(m.weight)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=1e-6) if ".mlp." in f".{name}." else nn.init.zeros_(m.bias)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # d c p q -> d (c p q): fan-in of the flattened patch
        nn.init.zeros_(self.patch_embed.proj.bias)
        for p in (self.pos_embed, self.cls_token, getattr(self, "dist_token", None)):
            if isinstance(p, nn.Parameter):
                nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
        if hasattr(self, "reg_token"):
            nn.init.normal_(self.reg_token, std=1e-6)  # as timm and DINOv2 start them
        if self.attn_pool is not None:
            nn.init.xavier_uniform_(self.attn_pool.latent.view(1, -1))  # as big_vision's probe
        if self.pre_logits is not None:  # flax's default Dense init, as the official code leaves it
            w = self.pre_logits.fc.weight
            std = w.shape[1] ** -0.5 / 0.87962566103423978  # LeCun normal, truncated at 2 sigma (variance kept)
            nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of the blocks (``Blocks``), timm's method name: memory for compute."""
        self.blocks.checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def _check_input(self, x: torch.Tensor) -> tuple[int, int]:
        if x.ndim != 4 or x.shape[1] != self.patch_embed.in_chans:
            raise ValueError(f"expected images of shape (B, {self.patch_embed.in_chans}, H, W), "
                             f"got {tuple(x.shape)}")
        hw = (x.shape[2], x.shape[3])
        if not self.config.dynamic_img_size and hw != to_2tuple(self.config.img_size):
            raise ValueError(f"this model takes {to_2tuple(self.config.img_size)} images, got {hw}: build it with "
                             "dynamic_img_size=True (any size divisible by the patch) or call "
                             f"model.set_input_size(img_size={hw})")
        return self.patch_embed.grid_for(hw)

    def _pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor | None:
        """E_pos for this grid: the stored table, or resampled (§3.2) when the image size differs."""
        if self.pos_embed is None:
            return None
        symbolic = any(isinstance(g, torch.SymInt) for g in grid)  # exported with a dynamic H and W
        if not symbolic and grid == self.patch_embed.grid_size:
            return self.pos_embed
        if self.config.pos_embed == "sincos2d":
            return self._sincos(grid).to(self.pos_embed)
        if symbolic:  # no branch on the size: the graph resamples for whatever size it is given
            n = self.config.pos_prefix_tokens
            return torch.cat([self.pos_embed[:, :n],
                              interpolate_grid(self.pos_embed[:, n:], self.patch_embed.grid_size, grid,
                                               self.config.pos_interp)], dim=1)
        return resample_pos_embed(self.pos_embed, grid, self.config.pos_prefix_tokens, self.patch_embed.grid_size,
                                  self.config.pos_interp)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 1: z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos. With a distillation token and registers the
        sequence is [x_class; x_dist; x_reg^1..R; patches]; with ``no_embed_class`` the prefix tokens get no E_pos."""
        grid = self._check_input(x)
        return self.embed_patches(self.patch_embed(x), grid)

    def embed_patches(self, x: torch.Tensor, grid: tuple[int, int], keep: torch.Tensor | None = None,
                      kept: bool = False) -> torch.Tensor:
        """Eq. 1 from the patch embeddings x_p E (B, N, D) of a ``grid``: each patch's E_pos added, then with
        ``keep`` (B, K) only those patches, in that order (MAE's encoder sees the visible quarter), and the prefix
        tokens with their own rows of E_pos before them. Self-supervision changes the patch embeddings here (the
        paper's [mask] embedding, §4.6) before the sequence is made. ``kept``: ``x`` is already those patches'
        embeddings (B, K, D) (``PatchEmbed.visible_cells``), and only their rows of E_pos are taken."""
        pos = self._pos_embed_for(grid)
        n = 0 if self.config.no_embed_class else self.config.pos_prefix_tokens  # E_pos rows of the prefix tokens
        if kept:
            if keep is None or keep.shape[:2] != x.shape[:2]:
                raise ValueError(f"embed_patches(kept=True): {tuple(x.shape)} embeddings need keep of (B, K) = "
                                 f"{tuple(x.shape[:2])}, got {None if keep is None else tuple(keep.shape)}")
            if pos is not None:
                x = x + torch.gather(pos[:, n:].expand(len(x), -1, -1), 1, keep[..., None].expand(-1, -1, x.shape[-1]))
        else:
            if pos is not None:
                x = x + pos[:, n:]
            if keep is not None:
                x = torch.gather(x, 1, keep[..., None].expand(-1, -1, x.shape[-1]))  # (B, K, D)
        prefix = [t.expand(x.shape[0], -1, -1) for t in self.prefix_tokens()]
        if prefix and pos is not None and n:
            prefix = list(torch.cat(prefix, 1).add(pos[:, :n]).split([t.shape[1] for t in prefix], 1))
        return self.pos_drop(torch.cat([*prefix, x], dim=1))  # (B, prefix + N, D)

    def embed_naflex(self, b: NaFlexBatch) -> torch.Tensor:
        """Eq. 1 for a NaFlex batch (model/naflex.py): the patches through E, each image's E_pos resampled to its
        own grid and looked up by the patches' coordinates, then the prefix tokens. Padding gets no E_pos."""
        pe, c = self.patch_embed, self.config
        if hasattr(pe, "backbone"):
            raise ValueError("NaFlex batches are cut from the image; a hybrid model's patches come from its CNN's "
                             "feature map: train it on fixed-size images")
        ph, pw = pe.patch_size
        if b.patches.shape[-1] != ph * pw * pe.in_chans:
            raise ValueError(f"NaFlex patches have {b.patches.shape[-1]} values each; this model takes {ph}x{pw} "
                             f"patches of {pe.in_chans} channels ({ph * pw * pe.in_chans})")
        x = pe.project(b.patches)  # (B, L, D)
        pos = None
        if self.pos_embed is not None:
            pos = torch.zeros_like(x)
            grids = b.grids()
            for grid in dict.fromkeys(grids):  # each grid size resampled once
                table = self._pos_embed_for(grid)[0, c.pos_prefix_tokens:].to(x.dtype)  # (gh * gw, D)
                rows = torch.tensor([i for i, g in enumerate(grids) if g == grid], device=x.device)
                where = b.coords[rows, :, 0] * grid[1] + b.coords[rows, :, 1]
                pos[rows] = table[where.clamp(0, table.shape[0] - 1)] * b.valid[rows, :, None]
            x = x + pos
        prefix = [t.expand(x.shape[0], -1, -1) for t in self.prefix_tokens()]
        if prefix and pos is not None and not c.no_embed_class:  # the prefix tokens' own rows of E_pos
            n = c.pos_prefix_tokens
            prefix = list(torch.cat(prefix, 1).add(self.pos_embed[:, :n]).split([t.shape[1] for t in prefix], 1))
        return self.pos_drop(torch.cat([*prefix, x], dim=1))

    def naflex_mask(self, b: NaFlexBatch) -> torch.Tensor:
        """(B, 1, 1, T): True for the keys every query may attend to (the prefix tokens and the valid patches)."""
        keep = torch.cat([b.valid.new_ones(len(b), self.num_prefix_tokens), b.valid], dim=1)
        return keep[:, None, None, :]

    def forward_features(self, x: torch.Tensor | NaFlexBatch) -> torch.Tensor:
        """Tokens after the encoder and its final LayerNorm, (B, T, D). A NaFlex batch's padding tokens are
        computed but attended to by nothing (their rows are meaningless)."""
        if isinstance(x, NaFlexBatch):
            mask, z = self.naflex_mask(x), self.embed_naflex(x)
            return self.norm(self.blocks(z, mask))
        return self.norm(self.blocks(self.embed(x)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False, valid: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Eq. 4: the class token's final state (or the mean of the patch tokens for GAP, or their attention
        pooling for MAP) into the head. DeiT's distilled model reads the distillation token's state with its own
        head and averages the two heads' logits, as its authors evaluate it."""
        if hasattr(self, "head_dist"):
            x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
            return (x + x_dist) / 2 if pre_logits else (self.head(x) + self.head_dist(x_dist)) / 2
        if self.config.pool == "cls":
            x = x[:, 0]
        elif self.attn_pool is not None:  # the probe attends over the patches (as timm's), the valid ones
            x = self.attn_pool(x[:, self.num_prefix_tokens:], None if valid is None else valid[:, None, None, :])
        elif valid is None:
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        else:  # the mean of the valid patches
            w = valid[..., None].to(x.dtype)
            x = (x[:, self.num_prefix_tokens:] * w).sum(1) / w.sum(1)
        x = self.fc_norm(x)
        x = self.head_drop(x if self.pre_logits is None else self.pre_logits(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor | NaFlexBatch) -> torch.Tensor:
        """Logits for a batch of images (B, C, H, W), or for a NaFlex batch of images at their own sizes."""
        return self.forward_head(self.forward_features(x), valid=x.valid if isinstance(x, NaFlexBatch) else None)

    def forward_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and the attention probabilities of every layer, each (B, heads, T, T), from the exact path."""
        with record_attention(self) as attns:
            logits = self(x)
        return logits, attns

    def set_attention(self, impl: str) -> "VisionTransformer":
        """``"sdpa"`` (the default), ``"exact"`` or a registered kernel (``register_attention``): see Attention."""
        set_attention(self, impl)
        return self

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, directory: str | os.PathLike, **preprocessing: Any) -> None:
        """Write ``config.json`` + ``model.safetensors`` (+ preprocessing) to ``directory``."""
        save_pretrained(self, directory, **preprocessing)


def flops_per_image(c: ViTConfig) -> float:
    """Forward FLOPs (2 x MACs) of the transformer's matmuls for one image, and of a hybrid's CNN, for utilisation
    figures and the planner's first estimate of a step."""
    gh, gw = c.grid_size  # (a hybrid's patches are cut from the CNN's map: the CIFAR-10 recipe's 8x8, not 32x32)
    n, t, d = gh * gw, gh * gw + c.num_prefix_tokens, c.embed_dim
    stem, chans = _stem_flops(c.hybrid, c.in_chans, to_2tuple(c.img_size)) if c.hybrid else (0.0, c.in_chans)
    patch = n * d * chans * math.prod(to_2tuple(c.patch_size))
    per_block = t * d * 3 * d + 2 * t * t * d + t * d * d + 2 * t * d * int(d * c.mlp_ratio)
    return 2.0 * (patch + c.depth * per_block + d * c.num_classes * (1 + c.dist_token)) + stem


@functools.lru_cache(maxsize=32)
def _stem_flops(spec: str, in_chans: int, img_size: tuple[int, int]) -> tuple[float, int]:
    """FLOPs of a hybrid's CNN for one image, counted by PyTorch's FlopCounterMode on the meta device (no memory,
    no weights initialised), and the channels of the map it hands the patch embedding."""
    from torch.utils.flop_counter import FlopCounterMode  # (only for a hybrid)

    with torch.device("meta"):
        stem, chans, _ = cnn_stem(spec, in_chans)
        x = torch.empty(1, in_chans, *img_size)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        stem.eval()(x)
    return float(counter.get_total_flops()), chans
