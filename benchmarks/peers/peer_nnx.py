"""Flax NNX peer: idiomatic `nnx.Module`s, `nnx.Optimizer` and `nnx.jit`; bf16 through the modules' `dtype`."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.peers.common import main
from benchmarks.peers.jax_common import cross_entropy, device_batch, spec
from benchmarks.train_steps import LEARNING_RATE


class MLP(nnx.Module):
    def __init__(self, in_features, hidden, classes, dtype, rngs):
        widths = (in_features, *hidden)
        self.hidden = nnx.List([nnx.Linear(a, b, dtype=dtype, rngs=rngs) for a, b in zip(widths, widths[1:])])
        self.out = nnx.Linear(widths[-1], classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


class CNN(nnx.Module):
    def __init__(self, image, widths, classes, dtype, rngs):
        chans = (image[-1], *widths)
        self.convs = nnx.List(
            [nnx.Conv(a, b, (3, 3), padding="SAME", dtype=dtype, rngs=rngs) for a, b in zip(chans, chans[1:])]
        )
        side = image[0] // 2 ** len(widths)
        self.out = nnx.Linear(side * side * widths[-1], classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        for conv in self.convs:
            x = nnx.max_pool(nnx.relu(conv(x)), (2, 2), (2, 2), padding="SAME")
        return self.out(x.reshape(x.shape[0], -1))


class Block(nnx.Module):
    def __init__(self, d, heads, dtype, rngs):
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dtype=dtype, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab, seq_len, d_model, num_layers, num_heads, dtype, rngs):
        self.embed = nnx.Embed(vocab, d_model, embedding_init=nnx.initializers.normal(0.02), dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (seq_len, d_model)))
        self.blocks = nnx.List([Block(d_model, num_heads, dtype, rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.dtype)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def make_model(name: str, dtype, rngs):
    s = spec(name)
    if s["kind"] == "mlp":
        return MLP(s["in_features"], s["hidden"], s["classes"], dtype, rngs)
    if s["kind"] == "cnn":
        return CNN(s["image"], s["widths"], s["classes"], dtype, rngs)
    return GPT(s["vocab"], s["seq_len"], s["d_model"], s["num_layers"], s["num_heads"], dtype, rngs)


def build(name: str, precision: str):
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    model = make_model(name, dtype, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    batch = device_batch(name)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            return cross_entropy(model(batch["x"]), batch["y"])

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def call():
        return train_step(model, optimizer, batch)

    return call


if __name__ == "__main__":
    sys.exit(main("flax_nnx", build))
