"""Learning from images alone: the paper's masked patch prediction (§4.6, Appendix B.1.2) and the masked
autoencoder of He et al. (2021). Each wraps an ordinary ``VisionTransformer`` (the encoder, saved and loaded as any
vitkit checkpoint) with the small parts its objective adds, and computes its loss from a batch of images.

Masked patch prediction (MPP), as B.1.2 states it: 50% of each image's patch embeddings x_p E are corrupted, 80% of
those replaced by one learnable [mask] embedding, 10% by the embedding of another patch, 10% kept as they are; from
each corrupted patch's output representation the model predicts its mean colour, each channel quantised to 3 bits
(512 classes; 8 for one channel), with cross-entropy over the corrupted patches only. The paper's two other targets:
a 4x4 downsized patch in 3-bit colours (16 predictions of 512 classes), and L2 regression of the whole patch.

MAE: 75% of the patches are masked and the encoder sees the other 25% alone; a lighter decoder with fixed 2-D
sin-cos position embeddings gets the encoded patches and a [mask] token at every masked place, and reconstructs
each masked patch's pixels (MSE on the masked patches; with ``norm_pix_loss`` each target patch is standardised by
its own mean and variance first).

    corrupted = patches at the positions masked                            (B, N) bool
    z = ViT(E_pos + [x_p E, or [mask], or another x_q E])                  (MPP)
    z = ViT(E_pos + x_p E of the visible patches)  -> decoder -> pixels    (MAE)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ViTConfig, to_2tuple
from .draws import draw
from .masked_stem import check_maskable
from .posembed import sincos_2d_pos_embed
from .serialization import atomic_write
from .vit import Block, VisionTransformer

MPP_TARGETS = ("mean", "4x4", "l2")
COLOUR_BITS = 3  # each channel of a colour quantised to 3 bits: 8 levels, 512 colours in RGB (B.1.2)


# ------------------------------------------------------------------------------------------ patches
def patchify(images: torch.Tensor, patch: int | tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, P*P*C), each patch flattened as (P, P, C): the order of ``PatchEmbed``, of MAE's
    official code and of Hugging Face's ``ViTMAEForPreTraining.patchify``."""
    p, q = to_2tuple(patch)
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // p, p, w // q, q)  # b c (gh p) (gw q) -> b c gh p gw q
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // q), p * q * c)  # -> b (gh gw) (p q c)


def unpatchify(patches: torch.Tensor, patch: int | tuple[int, int], grid: tuple[int, int], channels: int
               ) -> torch.Tensor:
    """(B, N, P*P*C) -> (B, C, H, W): ``patchify`` undone."""
    p, q = to_2tuple(patch)
    b, gh, gw = patches.shape[0], *grid
    x = patches.reshape(b, gh, gw, p, q, channels)  # b (gh gw) (p q c) -> b gh gw p q c
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, channels, gh * p, gw * q)


def colour_classes(channels: int) -> int:
    """Colours of ``COLOUR_BITS`` bits a channel: 512 in RGB, 8 in one channel."""
    return 2 ** (COLOUR_BITS * channels)


def quantised_colour(pixels: torch.Tensor, channels: int) -> torch.Tensor:
    """The class of a colour: each channel's value in [0, 1] (raw pixels, *before* standardisation: standardised
    values, clamped to [0, 1], crowd into a few classes at the ends of each channel) cut into 8 levels, the levels
    read as one number, red most significant. ``pixels`` (..., C) -> (...,) int64 in [0, 8^C)."""
    levels = 2 ** COLOUR_BITS
    q = (pixels.clamp(0, 1) * levels).long().clamp_(max=levels - 1)  # 1.0 is the top level, not a ninth
    weights = levels ** torch.arange(channels - 1, -1, -1, device=pixels.device)
    return (q * weights).sum(-1)


def mpp_targets(raw: torch.Tensor, patch: int | tuple[int, int], target: str) -> torch.Tensor:
    """What MPP predicts for every patch of raw images (B, C, H, W) in [0, 1]: ``mean``, the 3-bit mean colour
    (B, N); ``4x4``, the patch downsized to 4x4 in 3-bit colours (B, N, 16); ``l2``, the patch's pixels
    (B, N, P*P*C)."""
    c = raw.shape[1]
    p, q = to_2tuple(patch)
    if target == "l2":
        return patchify(raw, (p, q))
    if target == "mean":
        means = F.avg_pool2d(raw, (p, q))  # (B, C, gh, gw)
        return quantised_colour(means.flatten(2).transpose(1, 2), c)  # b c gh gw -> b (gh gw) c -> b n
    if p % 4 or q % 4:
        raise ValueError(f"the 4x4 target averages each patch into 4x4 cells: patch {(p, q)} does not divide by 4")
    cells = F.avg_pool2d(raw, (p // 4, q // 4))  # (B, C, 4 gh, 4 gw)
    return quantised_colour(patchify(cells, 4).reshape(raw.shape[0], -1, 16, c), c)  # b n (4 4 c) -> b n 16


@dataclass
class SSLOutput:
    """A self-supervised step's result: the loss, and what the figures and the evaluation read."""

    loss: torch.Tensor
    mask: torch.Tensor  # (B, N) bool: the patches the loss is over (corrupted, or hidden)
    pred: torch.Tensor  # MPP: (B, N, classes...) logits or pixels; MAE: (B, N, P*P*C) pixels
    correct: torch.Tensor | None = None  # MPP's classification targets: correct predictions over the masked patches
    count: torch.Tensor | None = None


def random_order(noise: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE's per-image shuffle from ``noise`` (B, N): the ``keep`` patches with the smallest noise are kept. Returns
    (ids_keep (B, keep), mask (B, N) True where hidden, ids_restore (B, N)), as He et al.'s ``random_masking`` and
    Hugging Face's (the same noise gives the same mask)."""
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    mask = torch.ones_like(noise, dtype=torch.bool)
    mask[:, :keep] = False
    return ids_shuffle[:, :keep], torch.gather(mask, 1, ids_restore), ids_restore


# ------------------------------------------------------------------------------------------ MPP (§4.6)
class MaskedPatchPrediction(nn.Module):
    """The paper's masked patch prediction: ``encoder`` (a ViT) + a learnable [mask] embedding + a linear head."""

    def __init__(self, encoder: VisionTransformer, target: str = "mean", corrupt: float = 0.5,
                 replace: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> None:
        super().__init__()
        if target not in MPP_TARGETS:
            raise ValueError(f"MPP target {target!r}: expected one of {', '.join(MPP_TARGETS)}")
        if not 0 < corrupt < 1:
            raise ValueError(f"mask ratio {corrupt:g}: the share of patches corrupted must be between 0 and 1")
        c = encoder.config
        check_maskable(c.hybrid)  # a hybrid's stem runs masked: the corrupted patches' pixels reach nothing
        self.encoder, self.target, self.corrupt, self.replace = encoder, target, corrupt, replace
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim))  # the [mask] embedding of B.1.2
        nn.init.trunc_normal_(self.mask_token, std=0.02, a=-0.04, b=0.04)
        p, q = encoder.patch_embed.cell  # the pixels of a patch (a hybrid's token: its cell of the image)
        colours = colour_classes(c.in_chans)
        out = {"mean": colours, "4x4": 16 * colours, "l2": p * q * c.in_chans}[target]
        self.head = nn.Linear(c.embed_dim, out)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"mask_token"}

    def noise(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The draws that decide a batch's corruption, (3, B, N) uniforms: which patches (their order), what each
        becomes, and which other patch replaces it. Drawn outside ``forward`` by the trainer, so that a compiled
        step is one graph (a generator cannot be traced)."""
        grid = self.encoder._check_input(x)
        return draw(torch.rand, 3, len(x), grid[0] * grid[1], generator=generator, on=x.device)

    def corrupted_ids(self, noise: torch.Tensor) -> torch.Tensor:
        """The corrupted patches of each image, (B, K) indices: round(corrupt x N) of them, the same K for every
        image (so that they gather into one tensor without the host learning a count)."""
        return noise[0].argsort(1)[:, :max(1, round(self.corrupt * noise.shape[2]))]

    def choose(self, noise: torch.Tensor,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(corrupted, to [mask], to another patch): (B, N) bool each; round(corrupt x N) patches of every image,
        ``ids`` (``corrupted_ids(noise)``, when the caller has them already)."""
        _, b, n = noise.shape
        ids = self.corrupted_ids(noise) if ids is None else ids
        corrupted = torch.zeros(b, n, dtype=torch.bool, device=noise.device).scatter_(1, ids, True)
        u = noise[1]
        to_mask = corrupted & (u < self.replace[0])
        to_other = corrupted & (u >= self.replace[0]) & (u < self.replace[0] + self.replace[1])
        return corrupted, to_mask, to_other

    def forward(self, x: torch.Tensor, raw: torch.Tensor, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> SSLOutput:
        """``x`` the standardised batch the encoder reads, ``raw`` the same images in [0, 1] (the targets);
        ``noise`` (``self.noise``) decides the corruption (drawn from ``generator`` when not given)."""
        enc = self.encoder
        grid = enc._check_input(x)
        if noise is None:
            noise = self.noise(x, generator)
        ids = self.corrupted_ids(noise)  # (B, K)
        corrupted, to_mask, to_other = self.choose(noise, ids)
        tokens = enc.patch_embed.masked(x, ~(to_mask | to_other), grid)  # x_p E: (B, N, D)
        b, n, d = tokens.shape
        other = (noise[2] * (b * n)).long().clamp_max(b * n - 1)  # any patch of the batch
        swapped = tokens.reshape(b * n, d)[other]  # (B, N, D)
        tokens = torch.where(to_mask[..., None], self.mask_token.to(tokens.dtype).expand(b, n, d), tokens)
        tokens = torch.where(to_other[..., None], swapped, tokens)
        z = enc.norm(enc.blocks(enc.embed_patches(tokens, grid)))[:, enc.num_prefix_tokens:]  # (B, N, D)
        # the loss is over the corrupted patches, so the head runs on them alone (half its work, and half the
        # loss's): gathered by index, a count the host knows, not cut out by the mask (x[mask] makes the host wait
        # for the device to learn its size: a sync a step on a GPU, and a graph break for torch.compile)
        pred = self.head(torch.gather(z, 1, ids[..., None].expand(-1, -1, d)))  # (B, K, out)
        target = mpp_targets(raw, enc.patch_embed.cell, self.target).reshape(b, n, -1)  # (B, N, cells or pixels)
        target = torch.gather(target, 1, ids[..., None].expand(-1, -1, target.shape[-1]))
        # every patch's prediction for the figures, zero where nothing was corrupted (no gradient flows back here)
        every = pred.new_zeros(b, n, pred.shape[-1]).scatter_(1, ids[..., None].expand(-1, -1, pred.shape[-1]),
                                                             pred.detach())
        if self.target == "l2":  # the whole patch's pixels, by squared error
            return SSLOutput((pred.float() - target).pow(2).mean(), corrupted, every)
        logits = pred.float().reshape(*target.shape, colour_classes(enc.config.in_chans))  # (B, K, cells, classes)
        loss = F.cross_entropy(logits.flatten(0, 2), target.flatten())
        hits = (logits.argmax(-1) == target).sum()
        return SSLOutput(loss, corrupted, every, hits, corrupted.sum() * target.shape[-1])


def colour_of_class(classes: torch.Tensor, channels: int) -> torch.Tensor:
    """``quantised_colour`` read back: each class (...,) as the centre of its levels, (..., C) in [0, 1]."""
    levels = 2 ** COLOUR_BITS
    digits = [(classes // levels ** i) % levels for i in range(channels - 1, -1, -1)]
    return (torch.stack(digits, -1).float() + 0.5) / levels


def mpp_picture(module: "MaskedPatchPrediction", raw: torch.Tensor, out: SSLOutput) -> tuple[torch.Tensor, ...]:
    """(what the model saw, what it predicted) as images in [0, 1] for a figure: the corrupted patches grey, then
    each corrupted patch filled with the mean colour it predicted (the 4x4 target: its 16 cells; l2: its pixels),
    the others as they were."""
    c = module.encoder.config
    p, q = module.encoder.patch_embed.cell
    grid = module.encoder.patch_embed.grid_size
    patches = patchify(raw, (p, q))
    seen = torch.where(out.mask[..., None], torch.full_like(patches, 0.5), patches)
    b, n = out.mask.shape
    if module.target == "l2":
        guess = out.pred.float().clamp(0, 1)
    else:
        classes = out.pred.float().reshape(b, n, -1, colour_classes(c.in_chans)).argmax(-1)  # (B, N, 1 or 16)
        colours = colour_of_class(classes, c.in_chans)  # (B, N, cells, C)
        cells = colours.shape[2]
        side = int(cells ** 0.5)
        cell = colours.reshape(b * n, side, side, c.in_chans).permute(0, 3, 1, 2)  # the patch's cells as a picture
        guess = F.interpolate(cell, size=(p, q), mode="nearest").permute(0, 2, 3, 1).reshape(b, n, p * q * c.in_chans)
    filled = torch.where(out.mask[..., None], guess, patches)
    return (unpatchify(seen, (p, q), grid, c.in_chans), unpatchify(filled, (p, q), grid, c.in_chans))


# ------------------------------------------------------------------------------------------ MAE
def decoder_config(encoder: ViTConfig, width: int | None = None, depth: int | None = None,
                   heads: int | None = None) -> ViTConfig:
    """MAE's decoder as a ViT config (its blocks are the encoder's kind). He et al.: 512 wide, 8 deep, 16 heads,
    for ViT-B/L/H encoders, far narrower than them; vitkit keeps that for encoders of 384 wide and more, and for
    smaller ones (ViT-Ti, the small models of a 2-core CPU) takes half the encoder's width and 2 blocks with heads
    of 32, which keeps the decoder under half the encoder's compute, as He et al.'s is (their Table 1a: a decoder
    of one block fine-tunes to 84.8% against eight blocks' 84.9%; the linear probe is what wants depth)."""
    big = encoder.embed_dim >= 384
    width = width or (512 if big else max(32, encoder.embed_dim // 2))
    depth = depth or (8 if big else 2)
    heads = heads or max(1, width // 32)
    if width % heads:
        raise ValueError(f"decoder width {width} is not divisible by its {heads} heads")
    if width % 4:  # (the decoder's fixed position table: sin and cos of the rows and of the columns, a quarter each)
        raise ValueError(f"decoder width {width}: its 2-D sin-cos position embedding needs a multiple of 4")
    return encoder.replace(embed_dim=width, depth=depth, num_heads=heads, hybrid=None, num_classes=0,
                           drop_path_rate=0.0, reg_tokens=0, dist_token=False, pool="cls", layer_scale=None)


class MaskedAutoencoder(nn.Module):
    """He et al.'s MAE: ``encoder`` (a ViT, seeing the visible patches only) and a decoder that reconstructs the
    masked ones. Parameter names follow Hugging Face's ``ViTMAEForPreTraining`` decoder (decoder_embed, mask_token,
    decoder_pos_embed, decoder_norm, decoder_pred; the blocks as vitkit's)."""

    def __init__(self, encoder: VisionTransformer, mask_ratio: float = 0.75, norm_pix_loss: bool = True,
                 decoder: ViTConfig | None = None) -> None:
        super().__init__()
        c = encoder.config
        if not 0 < mask_ratio < 1:
            raise ValueError(f"mask ratio {mask_ratio:g}: the share of patches masked must be between 0 and 1")
        n = encoder.patch_embed.num_patches
        if int(n * (1 - mask_ratio)) < 1:  # the encoder would see nothing but its prefix tokens
            raise ValueError(f"mask ratio {mask_ratio:g} hides every one of the {n} patches an image has: the encoder "
                             f"would see none (at most {1 - 1 / n:.3g} leaves it one)")
        p, q = encoder.patch_embed.cell  # the pixels of a patch (a hybrid's token: its cell of the image)
        if norm_pix_loss and p * q * c.in_chans < 2:
            raise ValueError(f"norm_pix_loss standardises each patch's pixels, and a {p}x{q} patch of {c.in_chans} "
                             "channel has one value (its variance is undefined: the loss would be NaN): pre-train "
                             "without it (--no-norm-pix-loss), or with larger patches")
        check_maskable(c.hybrid)  # a hybrid's stem runs masked: the hidden patches' pixels reach nothing
        if c.pool not in ("cls", "gap") or c.dist_token:
            raise ValueError(f"MAE's encoder is a plain ViT with a class token or mean pooling, not pool={c.pool!r}"
                             + (" with a distillation token" if c.dist_token else ""))
        self.encoder, self.mask_ratio, self.norm_pix_loss = encoder, mask_ratio, norm_pix_loss
        d = self.decoder_cfg = decoder or decoder_config(c)
        grid = encoder.patch_embed.grid_size
        self.decoder_embed = nn.Linear(c.embed_dim, d.embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d.embed_dim))
        # fixed 2-D sin-cos, a row of zeros for each prefix token; persistent, so weights loaded from elsewhere keep
        # their own table
        self.register_buffer("decoder_pos_embed", sincos_2d_pos_embed(grid, d.embed_dim, encoder.num_prefix_tokens))
        self.decoder_blocks = nn.Sequential(*[Block(d, 0.0) for _ in range(d.depth)])
        self.decoder_norm = nn.LayerNorm(d.embed_dim, eps=d.layer_norm_eps)
        self.decoder_pred = nn.Linear(d.embed_dim, p * q * c.in_chans)
        self._init_decoder()

    @torch.no_grad()
    def _init_decoder(self) -> None:
        """As He et al.: Xavier-uniform linears with zero biases, N(0, 0.02) mask token."""
        for m in [self.decoder_embed, self.decoder_pred, *self.decoder_blocks.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:  # (qkv_bias False: the decoder's blocks are the encoder's kind)
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"mask_token"}

    def visible(self) -> int:
        return int(self.encoder.patch_embed.num_patches * (1 - self.mask_ratio))

    def noise(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B, N) uniforms whose order decides the mask, as He et al.'s: drawn outside ``forward`` by the trainer,
        so that a compiled step is one graph (a generator cannot be traced)."""
        grid = self.encoder._check_input(x)
        return draw(torch.rand, len(x), grid[0] * grid[1], generator=generator, on=x.device)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None, generator: torch.Generator | None = None
                ) -> SSLOutput:
        """``x`` the standardised batch, which is also what is reconstructed (as He et al. and Hugging Face);
        ``noise`` (B, N) decides the mask as theirs does (drawn from ``generator`` when not given)."""
        enc = self.encoder
        grid = enc._check_input(x)
        n = grid[0] * grid[1]
        if noise is None:
            noise = self.noise(x, generator)
        keep, mask, restore = random_order(noise, int(n * (1 - self.mask_ratio)))
        tokens = enc.patch_embed.visible_cells(x, keep, grid)  # (B, K, D): the visible patches' x_p E alone
        z = enc.norm(enc.blocks(enc.embed_patches(tokens, grid, keep, kept=True)))  # the visible patches, the prefix
        pred = self.decode(z, restore)
        target = patchify(x, enc.patch_embed.cell).float()
        if self.norm_pix_loss:
            target = standardise_patches(target)
        loss = (pred.float() - target).pow(2).mean(-1)
        return SSLOutput((loss * mask).sum() / mask.sum(), mask, pred)

    def decode(self, z: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        """The encoded visible patches (and prefix tokens) -> every patch's pixels (B, N, P*P*C)."""
        k = self.encoder.num_prefix_tokens
        y = self.decoder_embed(z)
        b, n, d = y.shape[0], restore.shape[1], y.shape[2]
        patches = torch.cat([y[:, k:], self.mask_token.to(y.dtype).expand(b, n - (y.shape[1] - k), d)], dim=1)
        patches = torch.gather(patches, 1, restore[..., None].expand(-1, -1, d))  # unshuffled: patch i at place i
        y = torch.cat([y[:, :k], patches], dim=1) + self.decoder_pos_embed.to(y.dtype)
        return self.decoder_pred(self.decoder_norm(self.decoder_blocks(y)))[:, k:]

    def reconstruct(self, x: torch.Tensor, out: SSLOutput) -> torch.Tensor:
        """The images as the model fills them in (B, C, H, W), in ``x``'s standardised space: the visible patches as
        they are, the masked ones predicted. Where the loss standardised each patch (norm_pix_loss), the prediction
        is in the hidden patch's own units, whose mean and spread the model was never shown: they are taken from
        what it could know, the average of the image's visible patches' means and standard deviations (the hidden
        patch's true ones would paint its real brightness and contrast into the picture). Nothing of a hidden
        patch's pixels reaches the result."""
        c, cell = self.encoder.config, self.encoder.patch_embed.cell
        target = patchify(x, cell).float()
        pred = out.pred.float()
        if self.norm_pix_loss:
            visible = (~out.mask.bool()).float()[..., None]  # (B, N, 1)
            n = visible.sum(1, keepdim=True).clamp_min(1)
            mean = (target.mean(-1, keepdim=True) * visible).sum(1, keepdim=True) / n  # (B, 1, 1)
            std = ((target.var(-1, keepdim=True) + 1e-6).sqrt() * visible).sum(1, keepdim=True) / n
            pred = pred * std + mean
        both = torch.where(out.mask[..., None].bool(), pred, target)
        return unpatchify(both, cell, self.encoder.patch_embed.grid_size, c.in_chans)


class JointMAE(MaskedAutoencoder):
    """A classifier and MAE's decoder trained in one step (Das et al., "Limited Data, Unlimited Potential", WACV
    2024: MAE as an auxiliary task beside the classification): ``forward(x)`` is the classifier's logits (the
    encoder, every patch seen: how it is evaluated and saved), ``forward(x, u, noise)`` also MAE's output on the
    images ``u`` (labelled or not), one call so that a compiled step is one graph. Saved as a classifier with
    MAE's parts beside it (ssl.json, ssl.safetensors): ``vitkit eval``/``export`` read the classifier, ``inspect
    reconstruct`` and ``pretrain --init`` the decoder."""

    def forward(self, x: torch.Tensor, u: torch.Tensor | None = None,  # type: ignore[override]
                noise: torch.Tensor | None = None) -> Any:
        logits = self.encoder(x)
        if u is None:
            return logits
        return logits, super().forward(u, noise=noise)


def standardise_patches(target: torch.Tensor) -> torch.Tensor:
    """Each patch's pixels less their mean, over their standard deviation (MAE's norm_pix_loss; the variance is
    the unbiased one, as theirs)."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return (target - mean) / (var + 1e-6) ** 0.5


def ssl_config(module: nn.Module) -> dict[str, Any]:
    """What rebuilds ``module``'s objective parts around an encoder (saved beside them)."""
    if isinstance(module, MaskedAutoencoder):
        d = module.decoder_cfg
        return {"method": "mae", "mask_ratio": module.mask_ratio, "norm_pix_loss": module.norm_pix_loss,
                "decoder_width": d.embed_dim, "decoder_depth": d.depth, "decoder_heads": d.num_heads,
                "decoder_mlp_ratio": d.mlp_ratio}
    if isinstance(module, MaskedPatchPrediction):
        return {"method": "mpp", "target": module.target, "mask_ratio": module.corrupt, "replace": list(module.replace)}
    raise TypeError(f"not a self-supervised module: {type(module).__name__}")


# How a batch's masks come from the run's generator: 2 since MPP's and MAE's draws became ``noise()`` (drawn
# outside the module); a resumed run's train_state says which it was saved with (an MPP run saved before drew
# its corruption otherwise, and continues on other masks: the trainer says so)
MASKS_DRAWN = 2
SSL_WEIGHTS, SSL_CONFIG = "ssl.safetensors", "ssl.json"  # beside a checkpoint's encoder (model.safetensors)


def save_ssl_parts(module: nn.Module, directory: str | Path) -> None:
    """The objective's own parts (MAE's decoder, MPP's [mask] embedding and head) beside the encoder a checkpoint
    folder holds as an ordinary vitkit model: ``ssl.safetensors`` and ``ssl.json`` (what rebuilds them)."""
    d = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items() if not k.startswith("encoder.")}
    atomic_write(d / SSL_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write(d / SSL_CONFIG, lambda p: p.write_text(json.dumps({**ssl_config(module), "library": "vitkit"},
                                                                   indent=2)))


def load_ssl(directory: str | Path, encoder: VisionTransformer) -> nn.Module:
    """The self-supervised module a checkpoint folder holds: ``encoder`` (loaded from its model.safetensors) with
    the parts ``ssl.safetensors`` and ``ssl.json`` rebuild; a ValueError naming what is missing or does not fit."""
    d = Path(directory)
    missing = [n for n in (SSL_CONFIG, SSL_WEIGHTS) if not (d / n).is_file()]
    if missing:
        has = [n for n in (SSL_CONFIG, SSL_WEIGHTS) if n not in missing]
        raise FileNotFoundError(f"{d}: " + (f"{has[0]} is there, but not {missing[0]}" if has else
                                            f"no {SSL_CONFIG} and {SSL_WEIGHTS}") +
                                " (a self-supervised run's checkpoint has both beside the encoder: the settings and "
                                "the weights of its decoder or head)")
    try:
        cfg = json.loads((d / SSL_CONFIG).read_text())
    except ValueError as e:
        raise ValueError(f"{d / SSL_CONFIG}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{d / SSL_CONFIG}: not a self-supervised module's settings (a JSON object), got {cfg!r:.80}")
    try:
        module = build_ssl(encoder, cfg)
    except (ValueError, TypeError) as e:  # settings written by hand or by another tool: name the file, not a flag
        raise ValueError(f"{d / SSL_CONFIG}: {e}") from None
    try:
        state = load_file(str(d / SSL_WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{d / SSL_WEIGHTS}: not a readable safetensors file (truncated or not one: "
                         f"{' '.join(str(e).split())[:100]})") from None
    want = {k: v.shape for k, v in module.state_dict().items() if not k.startswith("encoder.")}
    for k, shape in want.items():
        if k not in state:
            raise ValueError(f"{d / SSL_WEIGHTS}: no {k!r} (expected by its {SSL_CONFIG})")
        if tuple(state[k].shape) != tuple(shape):
            raise ValueError(f"{d / SSL_WEIGHTS}: {k!r} has shape {tuple(state[k].shape)}; the encoder and "
                             f"{SSL_CONFIG} want {tuple(shape)}")
    if extra := sorted(set(state) - set(want)):
        raise ValueError(f"{d / SSL_WEIGHTS}: unexpected {extra[:3]}")
    module.load_state_dict({**{f"encoder.{k}": v for k, v in encoder.state_dict().items()}, **state})
    return module


def build_ssl(encoder: VisionTransformer, cfg: dict[str, Any], joint: bool = False) -> nn.Module:
    """The objective's module around ``encoder`` from ``ssl_config``'s mapping (MAE with ``joint``: beside the
    encoder's classifier, ``JointMAE``)."""
    method = cfg.get("method")
    if method == "mae":
        dec = decoder_config(encoder.config, cfg.get("decoder_width"), cfg.get("decoder_depth"),
                             cfg.get("decoder_heads"))
        if cfg.get("decoder_mlp_ratio"):
            dec = dec.replace(mlp_ratio=cfg["decoder_mlp_ratio"])
        return (JointMAE if joint else MaskedAutoencoder)(encoder, cfg.get("mask_ratio", 0.75),
                                                          cfg.get("norm_pix_loss", True), dec)
    if method == "mpp":
        return MaskedPatchPrediction(encoder, cfg.get("target", "mean"), cfg.get("mask_ratio", 0.5),
                                     tuple(cfg.get("replace", (0.8, 0.1, 0.1))))
    raise ValueError(f"self-supervised method {method!r}: expected mpp or mae")


def draw_noise(module: nn.Module, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``module``'s ``noise`` for ``x``, through the wrappers a run puts around it (DDP, torch.compile, EMA)."""
    while not hasattr(module, "noise"):
        module = getattr(module, "_orig_mod", None) or module.module
    return module.noise(x, generator)
