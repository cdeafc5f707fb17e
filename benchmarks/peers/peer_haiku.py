"""Haiku peer: idiomatic `hk.transform`ed modules and a plain `jax.jit` step; bf16 the jmp way (Haiku's own mixed
precision library): float32 parameters cast to bf16 inside the loss, so gradients come back in float32."""

from __future__ import annotations

import sys

import haiku as hk
import jax
import jax.numpy as jnp

from benchmarks.peers.common import main
from benchmarks.peers.jax_common import adam_step, cross_entropy, device_batch, spec


def forward(name: str):
    s = spec(name)

    def mlp(x):
        for width in s["hidden"]:
            x = jax.nn.relu(hk.Linear(width)(x))
        return hk.Linear(s["classes"])(x)

    def cnn(x):
        for width in s["widths"]:
            x = jax.nn.relu(hk.Conv2D(width, 3, padding="SAME")(x))
            x = hk.MaxPool(2, 2, "SAME")(x)
        return hk.Linear(s["classes"])(hk.Flatten()(x))

    def gpt(tokens):
        d, t = s["d_model"], tokens.shape[1]
        x = hk.Embed(s["vocab"], d, w_init=hk.initializers.RandomNormal(0.02))(tokens)
        pos = hk.get_parameter("pos", (s["seq_len"], d), init=hk.initializers.RandomNormal(0.02))
        x = x + pos[:t].astype(x.dtype)
        mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
        for _ in range(s["num_layers"]):
            h = hk.LayerNorm(-1, True, True, eps=1e-6)(x)
            x = x + hk.MultiHeadAttention(
                s["num_heads"], d // s["num_heads"], w_init=hk.initializers.VarianceScaling(1.0)
            )(h, h, h, mask=mask)
            h = hk.LayerNorm(-1, True, True, eps=1e-6)(x)
            x = x + hk.Linear(d)(jax.nn.gelu(hk.Linear(4 * d)(h)))
        return hk.Linear(s["vocab"])(hk.LayerNorm(-1, True, True, eps=1e-6)(x))

    return {"mlp": mlp, "cnn": cnn, "gpt": gpt}[s["kind"]]


def build(name: str, precision: str):
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    net = hk.without_apply_rng(hk.transform(forward(name)))
    batch = device_batch(name)
    params = net.init(jax.random.key(0), batch["x"])

    def cast(tree):
        return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def loss_fn(params, batch):
        return cross_entropy(net.apply(cast(params), cast(batch["x"])), batch["y"])

    return adam_step(loss_fn, params, name)


if __name__ == "__main__":
    sys.exit(main("haiku", build))
