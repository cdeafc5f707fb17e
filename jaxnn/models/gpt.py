"""A decoder-only transformer (GPT) for byte-level language modelling."""

from __future__ import annotations

import dataclasses

from jaxnn.layers import (
    Dense,
    Embedding,
    Layer,
    LayerNorm,
    PositionEmbedding,
    Repeat,
    RMSNorm,
    TransformerBlock,
    remat,
    serial,
)

POSITIONS = ("learned", "rope")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer over bytes: GPT-2-like by default, Llama-like with `position="rope"`,
    `norm="rms"` and `num_kv_heads` < `num_heads`."""

    vocab_size: int = 256  # bytes
    seq_len: int = 128
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    drop_prob: float = 0.0
    attention_implementation: str = "auto"
    # The modern variants (Llama-style: position="rope", norm="rms", num_kv_heads < num_heads).
    position: str = "learned"  # "learned": a position table of seq_len rows; "rope": rotary, no table, no limit
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm)
    num_kv_heads: int | None = None  # grouped-query attention; None: one key/value head per query head
    scan_layers: bool = False  # one Repeat (lax.scan) over the blocks: compile time independent of depth
    remat: bool = False  # recompute each block's activations in the backward pass (less memory, more compute)

    def __post_init__(self) -> None:
        if self.position not in POSITIONS:
            raise ValueError(f"GPTConfig: unknown position {self.position!r}; choose one of {POSITIONS}")

    def small(self) -> GPTConfig:
        """Width 64, 2 blocks of 2 heads, 32 bytes of context: the same model for tests and smoke runs."""
        return dataclasses.replace(self, seq_len=32, d_model=64, num_layers=2, num_heads=2)

    def num_params(self) -> int:
        """The parameter count, computed from the config without building the model."""
        d, heads = self.d_model, self.num_heads
        kv_width = (self.num_kv_heads or heads) * (d // heads)
        norm = 2 * d if self.norm == "layer" else d
        attention = (d * d + d) + (2 * d * kv_width + 2 * kv_width) + (d * d + d)  # q, kv, out
        mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
        positions = self.seq_len * d if self.position == "learned" else 0
        return (
            self.vocab_size * d * 2
            + positions
            + self.num_layers * (2 * norm + attention + mlp)
            + norm
            + self.vocab_size
        )


def GPT(cfg: GPTConfig = GPTConfig()) -> Layer:
    """Token embeddings, [learned position embeddings], `num_layers` causal pre-norm blocks, a final norm and
    next-token logits.

    Input: (B, T) integer token ids; output: (B, T, vocab_size) logits for the next token. Decodes with a KV cache
    (`jaxnn.generate`). With `position="learned"` sequences are at most `seq_len` long; with "rope" any length.
    """
    block = TransformerBlock(
        cfg.num_heads,
        drop_prob=cfg.drop_prob,
        causal=True,
        num_kv_heads=cfg.num_kv_heads,
        rope=cfg.position == "rope",
        norm=cfg.norm,
        attention_implementation=cfg.attention_implementation,
    )
    if cfg.remat:
        block = remat(block)
    blocks = [Repeat(block, cfg.num_layers, name="blocks")] if cfg.scan_layers else [block] * cfg.num_layers
    positions = [PositionEmbedding(cfg.seq_len)] if cfg.position == "learned" else []
    return serial(
        Embedding(cfg.vocab_size, cfg.d_model, init_scale=0.02),
        *positions,
        *blocks,
        (LayerNorm if cfg.norm == "layer" else RMSNorm)(name="ln_f"),
        Dense(cfg.vocab_size, name="logits"),
        name="gpt",
    )
