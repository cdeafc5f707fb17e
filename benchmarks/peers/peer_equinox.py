"""Equinox peer: idiomatic `eqx.nn` modules applied per example under `jax.vmap`, `eqx.filter_jit`; bf16 the
jmp/Equinox way: float32 parameters cast to bf16 inside the loss, so gradients come back in float32."""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from benchmarks.peers.common import main
from benchmarks.peers.jax_common import cross_entropy, device_batch, spec
from benchmarks.train_steps import LEARNING_RATE
from jaxnn.profile.timing import stepper


class MLP(eqx.Module):
    layers: list

    def __init__(self, in_features, hidden, classes, key):
        widths = (in_features, *hidden, classes)
        keys = jax.random.split(key, len(widths) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(widths, widths[1:], keys)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(eqx.Module):
    convs: list
    pool: eqx.nn.MaxPool2d
    out: eqx.nn.Linear

    def __init__(self, image, widths, classes, key):
        keys = jax.random.split(key, len(widths) + 1)
        chans = (image[-1], *widths)
        self.convs = [eqx.nn.Conv2d(a, b, 3, padding="SAME", key=k) for a, b, k in zip(chans, chans[1:], keys)]
        self.pool = eqx.nn.MaxPool2d(2, 2)
        side = image[0] // 2 ** len(widths)
        self.out = eqx.nn.Linear(side * side * widths[-1], classes, key=keys[-1])

    def __call__(self, x_HWC):
        x = jnp.transpose(x_HWC, (2, 0, 1))  # Equinox convolutions are channels-first
        for conv in self.convs:
            x = self.pool(jax.nn.relu(conv(x)))
        return self.out(x.reshape(-1))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, d, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d, eps=1e-6), eqx.nn.LayerNorm(d, eps=1e-6)
        self.attn = eqx.nn.MultiheadAttention(
            heads, d, use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True, key=k1
        )
        self.fc = eqx.nn.Linear(d, 4 * d, key=k2)
        self.proj = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, x_TD, mask_TT):
        h = jax.vmap(self.ln1)(x_TD)
        x_TD = x_TD + self.attn(h, h, h, mask=mask_TT)
        h = jax.vmap(self.ln2)(x_TD)
        return x_TD + jax.vmap(lambda v: self.proj(jax.nn.gelu(self.fc(v))))(h)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, seq_len, d_model, num_layers, num_heads, key):
        keys = jax.random.split(key, num_layers + 3)
        self.embed = eqx.nn.Embedding(weight=0.02 * jax.random.normal(keys[0], (vocab, d_model)))
        self.pos = 0.02 * jax.random.normal(keys[1], (seq_len, d_model))
        self.blocks = [Block(d_model, num_heads, k) for k in keys[3:]]
        self.ln_f = eqx.nn.LayerNorm(d_model, eps=1e-6)
        self.head = eqx.nn.Linear(d_model, vocab, key=keys[2])

    def __call__(self, tokens_T):
        x = jax.vmap(self.embed)(tokens_T) + self.pos[: tokens_T.shape[0]]
        mask = jnp.tril(jnp.ones((tokens_T.shape[0],) * 2, bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(lambda v: self.head(self.ln_f(v)))(x)


def make_model(name: str, key):
    s = spec(name)
    if s["kind"] == "mlp":
        return MLP(s["in_features"], s["hidden"], s["classes"], key)
    if s["kind"] == "cnn":
        return CNN(s["image"], s["widths"], s["classes"], key)
    return GPT(s["vocab"], s["seq_len"], s["d_model"], s["num_layers"], s["num_heads"], key)


def build(name: str, precision: str):
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    model = make_model(name, jax.random.key(0))
    tx = optax.adam(LEARNING_RATE)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    batch = device_batch(name)

    def cast(tree):
        return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)

    @eqx.filter_value_and_grad
    def loss_fn(model, batch):
        logits = jax.vmap(cast(model))(cast(batch["x"]))
        return cross_entropy(logits, batch["y"])

    # Equinox can donate every argument but the first, so the reused batch comes first here.
    @eqx.filter_jit(donate="all-except-first")
    def train_step(batch, state):
        model, opt_state = state
        loss, grads = loss_fn(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), loss

    return stepper(lambda state, batch: train_step(batch, state), (model, opt_state), batch)


if __name__ == "__main__":
    sys.exit(main("equinox", build))
