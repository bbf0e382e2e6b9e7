"""Look inside a ViT: attention maps and rollout (paper Fig. 6), mean attention distance, position-embedding
similarity and patch-embedding filters (Fig. 7); class-specific explanations and their faithfulness
(``explain``, ``faithfulness``). Arrays here; PNG plots in ``vitkit.inspect.plots``. Imported on first use
(``vitkit inspect --help`` lists the methods without importing torch)."""
from .._lazy import lazy_exports

METHODS = ("rollout", "attention-last", "grad-rollout", "gradcam")  # what `explain` draws
CLASS_SPECIFIC = ("grad-rollout", "gradcam")  # the methods whose map depends on the target class

__all__ = ["attention_maps", "attention_rollout", "mean_attention_distance", "pos_embed_similarity",
           "patch_embed_filters", "pixel_filters", "filter_components", "rollout_from_attentions",
           "mean_distance_from_attentions", "explain", "faithfulness", "Explanation", "Faithfulness", "METHODS"]
# (explain() lives in explanations.py: a module named explain would take the function's name in this package)
__getattr__, __dir__ = lazy_exports(__name__, {**{n: ".analysis" for n in __all__[:9]},
                                               **{n: ".explanations" for n in __all__[9:13]}}, globals())
