"""Data: the datasets (embedded digits, MNIST, Fashion-MNIST, CIFAR, image folders) decoded into memory,
batch augmentation on tensors, the distributed batch sampler and preprocessing for single images."""
from .datasets import DATASETS, DataSplits, ImageTensors, load_dataset
from .preprocess import data_config, transforms

__all__ = ["DATASETS", "DataSplits", "ImageTensors", "data_config", "load_dataset", "transforms"]
