"""Flax models with the official code's module structure, so that Flax itself names the parameters as the official
checkpoints name them: google-research/vision_transformer ``vit_jax/models_vit.py`` + ``models_resnet.py`` (Linen)
and google-research/big_vision ``big_vision/models/vit.py``. Written for the tests from those files (module order,
names, what is scanned, where the class token and the position embedding are added); dropout, which has no
parameters, is left out. ``approximate`` picks GELU's tanh form (the official default) or the exact one, so that a
comparison with PyTorch can be tight.

Also: ``flatten`` (the params tree as the ``.npz`` keys) and ``to_released_numbering`` (the Linen names of a
vision_transformer encoder block renamed to the pre-Linen ones of the released checkpoints).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import traverse_util


def flatten(params: Any, prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}


def to_released_numbering(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Linen's LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0 inside ``encoderblock_N`` ->
    the released files' LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3 (flax's
    ``convert_pre_linen`` maps the other way)."""
    rename = {"MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1", "LayerNorm_1": "LayerNorm_2",
              "MlpBlock_0": "MlpBlock_3"}
    out = {}
    for k, v in w.items():
        parts = k.split("/")
        if len(parts) > 2 and parts[0] == "Transformer" and parts[1].startswith("encoderblock_"):
            parts[2] = rename.get(parts[2], parts[2])
        out["/".join(parts)] = v
    return out


class MlpBlock(nn.Module):
    mlp_dim: int | None = None
    approximate: bool = True

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = nn.Dense(self.mlp_dim or 4 * d)(x)
        x = nn.gelu(x, approximate=self.approximate)
        return nn.Dense(d)(x)


class Encoder1DBlock(nn.Module):
    mlp_dim: int | None
    num_heads: int
    approximate: bool = True

    @nn.compact
    def __call__(self, x, _=None):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.mlp_dim, self.approximate)(y), None


# --- vision_transformer (models_vit.py, models_resnet.py) ---

def weight_standardize(w, axis, eps):
    w = w - jnp.mean(w, axis=axis)
    return w / (jnp.std(w, axis=axis) + eps)


class StdConv(nn.Conv):
    def param(self, name, init_fn, *init_args, **kw):
        param = super().param(name, init_fn, *init_args, **kw)
        if name == "kernel":
            param = weight_standardize(param, axis=[0, 1, 2], eps=1e-5)
        return param


class ResidualUnit(nn.Module):
    features: int
    strides: Sequence[int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        needs_projection = x.shape[-1] != self.features * 4 or self.strides != (1, 1)
        residual = x
        if needs_projection:
            residual = StdConv(self.features * 4, (1, 1), self.strides, use_bias=False, name="conv_proj")(residual)
            residual = nn.GroupNorm(name="gn_proj")(residual)
        y = StdConv(self.features, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.relu(nn.GroupNorm(name="gn1")(y))
        y = StdConv(self.features, (3, 3), self.strides, use_bias=False, name="conv2")(y)
        y = nn.relu(nn.GroupNorm(name="gn2")(y))
        y = StdConv(self.features * 4, (1, 1), use_bias=False, name="conv3")(y)
        y = nn.GroupNorm(name="gn3")(y)  # zero-initialised scale upstream; random here so the test sees it
        return nn.relu(residual + y)


class ResNetStage(nn.Module):
    block_size: int
    nout: int
    first_stride: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = ResidualUnit(self.nout, strides=self.first_stride, name="unit1")(x)
        for i in range(1, self.block_size):
            x = ResidualUnit(self.nout, strides=(1, 1), name=f"unit{i + 1}")(x)
        return x


class AddPositionEmbs(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, x.shape[1], x.shape[2]))


class Encoder(nn.Module):
    num_layers: int
    mlp_dim: int
    num_heads: int
    approximate: bool = True

    @nn.compact
    def __call__(self, x):
        x = AddPositionEmbs(name="posembed_input")(x)
        for lyr in range(self.num_layers):
            x, _ = Encoder1DBlock(self.mlp_dim, self.num_heads, self.approximate, name=f"encoderblock_{lyr}")(x)
        return nn.LayerNorm(name="encoder_norm")(x)


class VisionTransformer(nn.Module):
    num_classes: int
    patches: Sequence[int]
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    resnet_layers: Sequence[int] | None = None  # None: no ResNet; (): the root alone
    representation_size: int | None = None
    classifier: str = "token"
    approximate: bool = True

    @nn.compact
    def __call__(self, x):
        if self.resnet_layers is not None:
            width = 64
            x = StdConv(width, (7, 7), (2, 2), use_bias=False, name="conv_root")(x)
            x = nn.relu(nn.GroupNorm(name="gn_root")(x))
            x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
            if self.resnet_layers:
                x = ResNetStage(self.resnet_layers[0], width, (1, 1), name="block1")(x)
                for i, block_size in enumerate(self.resnet_layers[1:], 1):
                    x = ResNetStage(block_size, width * 2 ** i, (2, 2), name=f"block{i + 1}")(x)
        x = nn.Conv(self.hidden_size, self.patches, strides=self.patches, padding="VALID", name="embedding")(x)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        if self.classifier == "token":
            cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, c))
            x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = Encoder(self.num_layers, self.mlp_dim, self.num_heads, self.approximate, name="Transformer")(x)
        x = x[:, 0] if self.classifier == "token" else jnp.mean(x, axis=1)
        if self.representation_size is not None:
            x = jnp.tanh(nn.Dense(self.representation_size, name="pre_logits")(x))
        return nn.Dense(self.num_classes, name="head")(x)


# --- big_vision (big_vision/models/vit.py) ---

def posemb_sincos_2d(h, w, width, temperature=10_000.0):
    y, x = jnp.mgrid[:h, :w]
    omega = jnp.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / (temperature ** omega)
    y = jnp.einsum("m,d->md", y.flatten(), omega)
    x = jnp.einsum("m,d->md", x.flatten(), omega)
    return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)[None, :, :]


class BVEncoder(nn.Module):
    depth: int
    mlp_dim: int | None
    num_heads: int
    scan: bool = False
    approximate: bool = True

    @nn.compact
    def __call__(self, x):
        if self.scan:
            x, _ = nn.scan(Encoder1DBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                           in_axes=nn.broadcast, length=self.depth)(
                name="encoderblock", mlp_dim=self.mlp_dim, num_heads=self.num_heads,
                approximate=self.approximate)(x, None)
        else:
            for lyr in range(self.depth):
                x, _ = Encoder1DBlock(self.mlp_dim, self.num_heads, self.approximate, name=f"encoderblock_{lyr}")(x)
        return nn.LayerNorm(name="encoder_norm")(x)


class MAPHead(nn.Module):
    mlp_dim: int | None = None
    num_heads: int = 12
    approximate: bool = True

    @nn.compact
    def __call__(self, x):
        n, _, d = x.shape
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), x.dtype)
        probe = jnp.tile(probe, [n, 1, 1])
        x = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(probe, x)
        y = nn.LayerNorm()(x)
        x = x + MlpBlock(self.mlp_dim, self.approximate)(y)
        return x[:, 0]


class BigVisionViT(nn.Module):
    num_classes: int
    patch_size: Sequence[int]
    width: int
    depth: int
    num_heads: int
    mlp_dim: int | None = None
    posemb: str = "learn"
    pool_type: str = "gap"
    scan: bool = False
    approximate: bool = True

    @nn.compact
    def __call__(self, image):
        x = nn.Conv(self.width, self.patch_size, strides=self.patch_size, padding="VALID", name="embedding")(image)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        if self.posemb == "learn":
            x = x + self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)), (1, h * w, c))
        else:
            x = x + posemb_sincos_2d(h, w, c)
        if self.pool_type == "tok":
            cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, c), x.dtype)
            x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = BVEncoder(self.depth, self.mlp_dim, self.num_heads, self.scan, self.approximate, name="Transformer")(x)
        if self.pool_type == "map":
            x = MAPHead(self.mlp_dim, self.num_heads, self.approximate)(x)
        elif self.pool_type == "gap":
            x = jnp.mean(x, axis=1)
        else:  # tok
            x = x[:, 0]
        return nn.Dense(self.num_classes, name="head")(x)
