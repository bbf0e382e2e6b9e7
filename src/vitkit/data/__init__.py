"""Data: the datasets (embedded digits, MNIST, Fashion-MNIST, CIFAR, image folders) decoded into memory,
batch augmentation on tensors, the distributed batch sampler and preprocessing for single images.

The names below are imported on first use (``vitkit train --help`` lists the datasets without importing torch)."""
from .._lazy import lazy_exports

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "folder", "shards", "hf", "fake")
FILE_DATASETS = ("folder", "shards", "hf")  # images read from their files: in memory where they fit, else streamed

__getattr__, __dir__ = lazy_exports(__name__, {"DataSplits": ".datasets", "ImageTensors": ".datasets",
                                               "load_dataset": ".datasets", "data_config": ".preprocess",
                                               "transforms": ".preprocess"}, globals())

__all__ = ["DATASETS", "FILE_DATASETS", "DataSplits", "ImageTensors", "data_config", "load_dataset", "transforms"]
