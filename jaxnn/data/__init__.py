"""Data: local data sets as numpy arrays, the seeded host pipeline, and device prefetch."""

from jaxnn.data.datasets import FORMATS, IMAGE_FORMATS, DataError, ImageDataset, TextCorpus, synthetic
from jaxnn.data.loaders import (
    detect_format,
    load_cifar10,
    load_dataset,
    load_digits,
    load_mnist,
    load_text,
    read_cifar_batch,
    read_idx,
    read_idx_split,
    tokenize_corpus,
)
from jaxnn.data.pipeline import (
    PipelineConfig,
    TrainBatches,
    eval_batches,
    host_iterator,
    iterator_state,
    steps_per_epoch,
)
from jaxnn.data.prefetch import DevicePrefetch

__all__ = [
    "FORMATS",
    "IMAGE_FORMATS",
    "DataError",
    "DevicePrefetch",
    "ImageDataset",
    "PipelineConfig",
    "TextCorpus",
    "TrainBatches",
    "detect_format",
    "eval_batches",
    "host_iterator",
    "iterator_state",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_text",
    "read_cifar_batch",
    "read_idx",
    "read_idx_split",
    "steps_per_epoch",
    "synthetic",
    "tokenize_corpus",
]
