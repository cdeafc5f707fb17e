"""Element-wise activations and softmax, as parameter-free layers (and Dropout, which needs a key)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxnn.layers.core import Lambda, Layer, check_keywords
from jaxnn.precision import accumulation_dtype

Relu = Lambda(jax.nn.relu, "relu")
Gelu = Lambda(jax.nn.gelu, "gelu")  # tanh approximation, as in GPT-2 and Flax's default
GeluExact = Lambda(lambda x: jax.nn.gelu(x, approximate=False), "gelu_exact")  # x * Phi(x), as PyTorch's default
Silu = Lambda(jax.nn.silu, "silu")
Tanh = Lambda(jnp.tanh, "tanh")
# Softmax over the last axis, computed in float32 and returned in the input dtype.
Softmax = Lambda(lambda x: jax.nn.softmax(x.astype(accumulation_dtype(x.dtype)), axis=-1).astype(x.dtype), "softmax")


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
