"""Element-wise activations and softmax, as parameter-free layers (and Dropout, which needs a key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxnn.layers.combinators import Lambda
from jaxnn.layers.core import Layer, as_layer, check_keywords, describe, is_layer_constructor
from jaxnn.precision import accumulation_dtype

Relu = Lambda(jax.nn.relu, "relu")
Gelu = Lambda(jax.nn.gelu, "gelu")  # tanh approximation, as in GPT-2 and Flax's default
GeluExact = Lambda(lambda x: jax.nn.gelu(x, approximate=False), "gelu_exact")  # x * Phi(x), as PyTorch's default
Silu = Lambda(jax.nn.silu, "silu")
Tanh = Lambda(jnp.tanh, "tanh")
Sigmoid = Lambda(jax.nn.sigmoid, "sigmoid")
Softplus = Lambda(jax.nn.softplus, "softplus")
# Softmax over the last axis, computed in float32 and returned in the input dtype.
Softmax = Lambda(lambda x: jax.nn.softmax(x.astype(accumulation_dtype(x.dtype)), axis=-1).astype(x.dtype), "softmax")


@describe
def LeakyRelu(negative_slope: float = 0.01, name: str = "leaky_relu") -> Layer:
    """`x` where positive, `negative_slope * x` elsewhere (PyTorch's and Keras' default slope 0.01, 0.2 in GANs)."""
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)):
        raise ValueError(f"LeakyRelu: negative_slope must be a number, got {negative_slope!r}")
    return Lambda(lambda x: jax.nn.leaky_relu(x, negative_slope), name)


@describe
def Elu(alpha: float = 1.0, name: str = "elu") -> Layer:
    """`x` where positive, `alpha * (exp(x) - 1)` elsewhere."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"Elu: alpha must be a number, got {alpha!r}")
    return Lambda(lambda x: jax.nn.elu(x, alpha), name)


# `activation=` names (Dense, Conv) -> the element-wise function, as Keras names them.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
    "leaky_relu": jax.nn.leaky_relu,
    "elu": jax.nn.elu,
    "softmax": lambda x: Softmax.apply({}, x),
    "linear": lambda x: x,
}


def activation_fn(activation: Any, owner: str) -> Callable[[jax.Array], jax.Array] | None:
    """`activation=` as a function of the layer's output: a name in ACTIVATIONS, a parameter-free Layer (`L.Relu`,
    `L.LeakyRelu(0.2)`), a function of an array, or None (no activation)."""
    if activation is None:
        return None
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        return ACTIVATIONS[activation]
    if isinstance(activation, Layer) or is_layer_constructor(activation):
        layer = as_layer(activation, f"{owner}: activation")
        return lambda y: layer.apply({}, y)
    if callable(activation):
        return activation
    raise TypeError(f"{owner}: activation must be a name, a Layer or a function, got {type(activation).__name__}")


@describe
def Dropout(drop_prob: float, name: str = "dropout") -> Layer:
    """Zeroes each element with probability `drop_prob` in train mode and rescales the rest by 1/(1-drop_prob).

    Identity in eval mode. Train mode needs an explicit `key=`.
    """
    if not (isinstance(drop_prob, (int, float)) and 0 <= drop_prob < 1):
        raise ValueError(f"Dropout: drop_prob must be in [0, 1), got {drop_prob!r}")

    def init(key, in_shape):
        return tuple(in_shape), {}

    def apply(params, x, *, key=None, train=False, **kwargs):
        check_keywords(name, kwargs)
        if not train or drop_prob == 0:
            return x
        if key is None:
            raise ValueError(f"{name}: train=True needs a PRNG key (key=...)")
        keep = jax.random.bernoulli(key, 1.0 - drop_prob, x.shape)
        return jnp.where(keep, x / (1.0 - drop_prob), 0).astype(x.dtype)

    return Layer(init, apply, name)
