"""jaxnn layers: each an `(init, apply)` pair of pure functions; see `jaxnn.layers.core` for the convention."""

from jaxnn.layers.activation import Dropout, Gelu, Relu, Silu, Softmax, Tanh
from jaxnn.layers.attention import MultiHeadAttention, TransformerBlock
from jaxnn.layers.conv import Conv
from jaxnn.layers.core import Lambda, Layer, init_model, output_shape, parallel, residual, run, serial
from jaxnn.layers.linear import Dense, Embedding, Flatten, PositionEmbedding
from jaxnn.layers.norm import BatchNorm, LayerNorm, RMSNorm
from jaxnn.layers.pool import AvgPool, GlobalAvgPool, MaxPool
from jaxnn.layers.tabulate import ModelSummary, SummaryRow, summary

__all__ = [
    "AvgPool",
    "BatchNorm",
    "Conv",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "Gelu",
    "GlobalAvgPool",
    "Lambda",
    "Layer",
    "LayerNorm",
    "MaxPool",
    "ModelSummary",
    "MultiHeadAttention",
    "PositionEmbedding",
    "RMSNorm",
    "Relu",
    "Silu",
    "Softmax",
    "SummaryRow",
    "Tanh",
    "TransformerBlock",
    "init_model",
    "output_shape",
    "parallel",
    "residual",
    "run",
    "serial",
    "summary",
]
