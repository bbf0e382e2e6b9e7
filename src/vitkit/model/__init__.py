"""The model: config (Table 1), the ViT itself (Eq. 1-4), position embeddings, presets and checkpoints."""
from .config import PRESETS, ViTConfig
from .hub import from_pretrained, save_pretrained
from .posembed import resample_pos_embed, sincos_2d_pos_embed
from .registry import create_model, get_config, list_models
from .vit import VisionTransformer, flops_per_image, record_attention, set_attention

__all__ = ["PRESETS", "ViTConfig", "VisionTransformer", "create_model", "get_config", "list_models",
           "from_pretrained", "save_pretrained", "resample_pos_embed", "sincos_2d_pos_embed", "flops_per_image",
           "record_attention", "set_attention"]
