"""Look inside a ViT: attention maps and rollout (paper Fig. 6), mean attention distance, position-embedding
similarity and patch-embedding filters (Fig. 7); class-specific explanations and their faithfulness
(``explain``, ``faithfulness``). Arrays here; PNG plots in ``vitkit.inspect.plots``."""
from .analysis import (attention_maps, attention_rollout, filter_components, mean_attention_distance,
                       mean_distance_from_attentions, patch_embed_filters, pixel_filters, pos_embed_similarity,
                       rollout_from_attentions)
from .explain import METHODS, Explanation, Faithfulness, explain, faithfulness

__all__ = ["attention_maps", "attention_rollout", "mean_attention_distance", "pos_embed_similarity",
           "patch_embed_filters", "pixel_filters", "filter_components", "rollout_from_attentions",
           "mean_distance_from_attentions", "explain", "faithfulness", "Explanation", "Faithfulness", "METHODS"]
