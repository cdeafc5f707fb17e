"""A decoder-only transformer (GPT) for byte-level language modelling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxnn.layers import Dense, Embedding, Layer, LayerNorm, Params, PositionEmbedding, State, TransformerBlock, serial


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    drop_prob: float = 0.0
    attention_implementation: str = "auto"

    def small(self) -> GPTConfig:
        return dataclasses.replace(self, seq_len=32, d_model=64, num_layers=2, num_heads=2)

    def num_params(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d
        return self.vocab_size * d * 2 + self.seq_len * d + self.num_layers * per_block + 2 * d + self.vocab_size


def GPT(cfg: GPTConfig = GPTConfig()) -> Layer:
    """Token and position embeddings, `num_layers` causal pre-norm blocks, a final LayerNorm and byte logits.

    Input: (B, T) integer byte ids; output: (B, T, vocab_size) logits for the next byte.
    """
    blocks = [
        TransformerBlock(
            cfg.num_heads, drop_prob=cfg.drop_prob, causal=True, attention_implementation=cfg.attention_implementation
        )
        for _ in range(cfg.num_layers)
    ]
    return serial(
        Embedding(cfg.vocab_size, cfg.d_model, init_scale=0.02),
        PositionEmbedding(cfg.seq_len),
        *blocks,
        LayerNorm(name="ln_f"),
        Dense(cfg.vocab_size, name="logits"),
        name="gpt",
    )


def sample(
    predict: Callable[[Params, State, np.ndarray], Any],
    params: Params,
    model_state: State,
    prompt: bytes,
    n: int,
    seq_len: int,
    *,
    seed: int = 0,
    temperature: float = 0.8,
) -> bytes:
    """Samples `n` bytes after `prompt` from a byte GPT, one compiled (1, seq_len) forward pass per byte.

    `predict` is `jaxnn.train.make_predict(model, policy)`; the context is the last `seq_len` bytes.
    """
    import jax

    if temperature <= 0:
        raise ValueError(f"sample: temperature must be positive, got {temperature!r}")
    rng = np.random.default_rng(seed)
    context = list(prompt[-seq_len:]) or [0]
    out = []
    for _ in range(n):
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(context)] = context
        logits = np.asarray(jax.device_get(predict(params, model_state, window)))[0, len(context) - 1]
        logits = logits.astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        token = int(rng.choice(len(p), p=p / p.sum()))
        out.append(token)
        context = (context + [token])[-seq_len:]
    return bytes(out)
