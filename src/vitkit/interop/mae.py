"""Other people's masked autoencoders: Hugging Face ``ViTMAEModel`` (the encoder) and ``ViTMAEForPreTraining`` (the
encoder and its decoder) as a vitkit ``MaskedAutoencoder`` whose encoder is an ordinary vitkit ViT. (timm's
``*.mae`` weights are plain ViTs without a head: they load as any timm ViT.)

The encoder's names are Hugging Face's ViT names (interop/hf.py); the decoder's blocks are ViT layers under
``decoder.decoder_layers.N``, its other parts named as vitkit names them (decoder_embed, mask_token,
decoder_pos_embed, decoder_norm, decoder_pred). Both position tables are taken as they are (MAE fixes them to its
own 2-D sin-cos, whose frequencies differ from big_vision's that vitkit computes).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..model.config import ViTConfig
from ..model.ssl import MaskedAutoencoder, build_ssl
from ..model.vit import VisionTransformer
from .files import read_hf_folder
from .hf import hf_to_vitkit

DECODER_PARTS = ("mask_token", "decoder_pos_embed", "decoder_embed.weight", "decoder_embed.bias",
                 "decoder_norm.weight", "decoder_norm.bias", "decoder_pred.weight", "decoder_pred.bias")


def hf_mae_config(hc: dict[str, Any]) -> tuple[ViTConfig, dict[str, Any]]:
    """(the encoder's ViTConfig, the MAE settings) of a ViTMAE config.json."""
    if hc.get("model_type") != "vit_mae":
        raise ValueError(f"Hugging Face model_type {hc.get('model_type')!r} is not 'vit_mae'")
    if hc.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {hc['hidden_act']!r} is not supported (only exact 'gelu')")
    enc = ViTConfig(img_size=hc.get("image_size", 224), patch_size=hc.get("patch_size", 16),
                    in_chans=hc.get("num_channels", 3), num_classes=0, embed_dim=hc["hidden_size"],
                    depth=hc["num_hidden_layers"], num_heads=hc["num_attention_heads"],
                    mlp_ratio=hc["intermediate_size"] / hc["hidden_size"], qkv_bias=hc.get("qkv_bias", True),
                    layer_norm_eps=hc.get("layer_norm_eps", 1e-12))
    ratio = hc.get("mask_ratio", 0.75)
    if not 0 < ratio < 1:  # 0: Hugging Face's setting for every patch's features; the encoder needs no mask ratio,
        ratio = 0.75  # and pre-training continued from it masks He et al.'s share (--mask-ratio to choose)
    ssl = {"method": "mae", "mask_ratio": ratio, "norm_pix_loss": hc.get("norm_pix_loss", False),
           "decoder_width": hc.get("decoder_hidden_size", 512), "decoder_depth": hc.get("decoder_num_hidden_layers", 8),
           "decoder_heads": hc.get("decoder_num_attention_heads", 16),
           "decoder_mlp_ratio": hc.get("decoder_intermediate_size", 2048) / hc.get("decoder_hidden_size", 512)}
    return enc, ssl


def hf_mae_to_vitkit(sd: dict[str, torch.Tensor], source: str = "Hugging Face MAE weights"
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the encoder's state dict in vitkit's names, the decoder's in MaskedAutoencoder's names without
    ``encoder.``; empty for a ViTMAEModel, which has none)."""
    encoder, decoder_blocks, parts = {}, {}, {}
    for key, v in sd.items():
        if m := re.match(r"decoder\.decoder_(?:layers|encoder\.layer)\.(.+)$", key):  # in memory; as saved
            decoder_blocks[f"encoder.layer.{m.group(1)}"] = v  # read as an encoder's layers, named the decoder's
        elif key.startswith("decoder."):
            name = key[len("decoder."):]
            if name not in DECODER_PARTS:
                raise ValueError(f"{source}: unexpected key {key!r}")
            parts[name] = v
        else:
            encoder[key] = v
    enc = hf_to_vitkit(encoder, source)
    if decoder_blocks:
        for k, v in hf_to_vitkit(decoder_blocks, source).items():
            parts[f"decoder_{k}"] = v  # blocks.N... -> decoder_blocks.N...
    return enc, parts


def is_hf_mae(path: Path) -> bool:
    """A Hugging Face folder of a ViTMAE model (config.json's model_type ``vit_mae``)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == "vit_mae"
    except (OSError, ValueError, AttributeError):
        return False


def from_hf_mae(model_or_dir: Any) -> MaskedAutoencoder:
    """A vitkit MaskedAutoencoder from a ``transformers`` ViTMAEForPreTraining (or ViTMAEModel: a new decoder) object
    or a saved folder (config.json + weights); its outputs are Hugging Face's for the same ``noise``."""
    if isinstance(model_or_dir, torch.nn.Module):
        hc, sd = model_or_dir.config.to_dict(), model_or_dir.state_dict()
    else:
        hc, sd = read_hf_folder(model_or_dir)
    cfg, ssl = hf_mae_config(hc)
    enc_sd, parts = hf_mae_to_vitkit(sd)
    encoder = VisionTransformer(cfg)
    missing, unexpected = encoder.load_state_dict(enc_sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"Hugging Face MAE weights: the encoder lacks {missing[:3]} / has unexpected {unexpected[:3]}")
    mae = build_ssl(encoder, ssl)
    if parts:
        want = {k for k in mae.state_dict() if not k.startswith("encoder.")}
        if set(parts) != want:
            raise ValueError(f"Hugging Face MAE weights: decoder keys differ: missing {sorted(want - set(parts))[:3]}, "
                             f"unexpected {sorted(set(parts) - want)[:3]}")
        mae.load_state_dict({**{f"encoder.{k}": v for k, v in encoder.state_dict().items()}, **parts})
    return mae
