"""jaxnn layers: each an `(init, apply)` pair of pure functions; see `jaxnn.layers.core` for the convention."""

from jaxnn.layers.activation import Dropout, Gelu, Relu, Silu, Softmax, Tanh
from jaxnn.layers.attention import MultiHeadAttention, TransformerBlock
from jaxnn.layers.conv import Conv
from jaxnn.layers.core import (
    ApplyFn,
    InitFn,
    InitStateFn,
    Lambda,
    Layer,
    Params,
    PRNGKey,
    Shape,
    State,
    init_model,
    output_shape,
    parallel,
    residual,
    run,
    serial,
)
from jaxnn.layers.linear import Dense, Embedding, Flatten, PositionEmbedding
from jaxnn.layers.norm import BatchNorm, LayerNorm, RMSNorm
from jaxnn.layers.pool import AvgPool, GlobalAvgPool, MaxPool
from jaxnn.layers.tabulate import ModelSummary, SummaryRow, summary

__all__ = [
    "ApplyFn",
    "AvgPool",
    "BatchNorm",
    "Conv",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "Gelu",
    "GlobalAvgPool",
    "InitFn",
    "InitStateFn",
    "Lambda",
    "Layer",
    "LayerNorm",
    "MaxPool",
    "ModelSummary",
    "MultiHeadAttention",
    "PRNGKey",
    "Params",
    "PositionEmbedding",
    "RMSNorm",
    "Relu",
    "Shape",
    "Silu",
    "Softmax",
    "State",
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
