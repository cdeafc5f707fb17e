"""Flax Linen peer: idiomatic modules; bf16 through the modules' `dtype` (parameters stay float32)."""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.peers.common import main
from benchmarks.peers.jax_common import adam_step, cross_entropy, device_batch, spec


class MLP(nn.Module):
    hidden: tuple
    classes: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        for width in self.hidden:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
        return nn.Dense(self.classes, dtype=self.dtype)(x)


class CNN(nn.Module):
    widths: tuple
    classes: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            x = nn.relu(nn.Conv(width, (3, 3), padding="SAME", dtype=self.dtype)(x))
            x = nn.max_pool(x, (2, 2), (2, 2), padding="SAME")
        return nn.Dense(self.classes, dtype=self.dtype)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, mask):
        d = x.shape[-1]
        h = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        x = x + nn.SelfAttention(self.heads, dtype=self.dtype)(h, mask=mask)
        h = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        h = nn.Dense(d, dtype=self.dtype)(nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(h)))
        return x + h


class GPT(nn.Module):
    vocab: int
    seq_len: int
    d_model: int
    num_layers: int
    num_heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, embedding_init=nn.initializers.normal(0.02), dtype=self.dtype)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
        x = x + pos[: tokens.shape[1]].astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.num_layers):
            x = Block(self.num_heads, self.dtype)(x, mask)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype)(x)


def make_module(name: str, dtype):
    s = spec(name)
    if s["kind"] == "mlp":
        return MLP(s["hidden"], s["classes"], dtype)
    if s["kind"] == "cnn":
        return CNN(s["widths"], s["classes"], dtype)
    return GPT(s["vocab"], s["seq_len"], s["d_model"], s["num_layers"], s["num_heads"], dtype)


def build(name: str, precision: str):
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    module = make_module(name, dtype)
    batch = device_batch(name)
    params = module.init(jax.random.key(0), batch["x"])

    def loss_fn(params, batch):
        return cross_entropy(module.apply(params, batch["x"]), batch["y"])

    return adam_step(loss_fn, params, name)


if __name__ == "__main__":
    sys.exit(main("flax_linen", build))
