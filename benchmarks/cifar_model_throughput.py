"""Training img/s of the CIFAR-10 models of `vitkit reproduce` (and the recipe hybrid), fp32/bf16, eager/compiled,
one after another in one process (results/train-throughput-cpu.csv).

    python benchmarks/cifar_model_throughput.py resnet,resnet-narrow,hybrid,hybrid-narrow,vit fp32,bf16 \
        [CIFAR_DIR_OR_ZIP]
"""
import sys
import time

from vitkit.bench.training import vitkit_train_throughput
from vitkit.data.datasets import default_cache_dir, load_dataset
from vitkit.training.config import TrainConfig, recipe

data = load_dataset("folder", sys.argv[3] if len(sys.argv) > 3 else "../shared/data/cifar10-jpg.zip",
                    cache_dir=default_cache_dir(), max_side=32)
RESNET = dict(patch_size=1, depth=0, num_heads=4, pool="gap", pos_embed="none")
MODELS = {
    "resnet": dict(RESNET, embed_dim=256, hybrid="conv:64,R64,M,R128,M,R256"),
    "resnet-narrow": dict(RESNET, embed_dim=128, hybrid="conv:32,R32,M,R64,M,R128"),
    "hybrid": dict(patch_size=1, embed_dim=128, depth=4, num_heads=4, hybrid="conv:64,64,M,128,128,M"),
    "hybrid-narrow": dict(patch_size=1, embed_dim=128, depth=4, num_heads=4, hybrid="conv:32,32,M,64,64,M"),
    "vit": dict(patch_size=4, embed_dim=128, depth=6, num_heads=4, hybrid=None),
}
for name in sys.argv[1].split(","):
    for prec in sys.argv[2].split(","):
        for comp in (False, True):
            cfg = TrainConfig(**{**recipe("cifar10"), "dataset": "folder", "precision": prec, "compile": comp,
                                 "model_args": {"img_size": 32, **MODELS[name]}})
            t = time.time()
            ips = vitkit_train_throughput(cfg, data, steps=15, warmup=4)
            print(f"{name:14s} {prec} compile={comp}: {ips:7.0f} img/s  ({time.time() - t:.0f} s incl. warm-up)",
                  flush=True)
