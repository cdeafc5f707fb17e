"""A decoder-only transformer (GPT) for byte-level language modelling."""

from __future__ import annotations

import dataclasses

from jaxnn import precision
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
from jaxnn.layers.core import describe
from jaxnn.layers.stack import REMAT_POLICIES
from jaxnn.layers.transformer import MLPS

POSITIONS = ("learned", "rope")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer: a byte-level GPT-2-like model by default; GPT-2 itself with `tie_embeddings`
    and its vocabulary; Llama-style with `position="rope"`, `norm="rms"`, `mlp="swiglu"`, `bias=False` and
    `num_kv_heads` < `num_heads`. `jaxnn.models.presets` names the published shapes."""

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
    # Recompute each block's activations in the backward pass (less memory, more compute): False, True (keep only
    # the block's input) or a policy name of jaxnn.layers.REMAT_POLICIES ("dots", "dots_no_batch", "offload", ...).
    remat: bool | str = False
    # What published checkpoints differ in (GPT-2: tied, eps 1e-5; Llama: swiglu, no biases, its own hidden width).
    tie_embeddings: bool = False  # next-token logits from the embedding table (no separate output layer)
    mlp: str = "gelu"  # "gelu" (fc, tanh-GELU, proj) or "swiglu" (gate, up, down)
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4 * d_model
    bias: bool = True  # biases in the attention and MLP projections
    # A bias on the next-token logits: GPT-2, Llama and most LMs have none (their export formats have no place for
    # one). Runs saved before this field existed had one exactly when `bias` was set (see `model_from_record`).
    logits_bias: bool = False
    norm_eps: float = 1e-6
    rope_base: float = 10000.0  # the rotary embeddings' wavelength base (Llama 2: 1e4, Llama 3: 5e5)
    head_dim: int | None = None  # None: d_model // num_heads

    def __post_init__(self) -> None:
        if self.position not in POSITIONS:
            raise ValueError(f"GPTConfig: unknown position {self.position!r}; choose one of {POSITIONS}")
        if self.mlp not in MLPS:
            raise ValueError(f"GPTConfig: unknown mlp {self.mlp!r}; choose one of {MLPS}")
        if not isinstance(self.remat, bool) and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"GPTConfig: remat must be true, false or a policy ({', '.join(REMAT_POLICIES)}), got {self.remat!r}"
            )

    def small(self) -> GPTConfig:
        """Width 64, 2 blocks of 2 heads, 32 bytes of context: the same model for tests and smoke runs."""
        return dataclasses.replace(self, seq_len=32, d_model=64, num_layers=2, num_heads=2)

    def num_params(self) -> int:
        """The parameter count, computed from the config without building the model."""
        d, heads = self.d_model, self.num_heads
        head = self.head_dim or d // heads
        q_width, kv_width = heads * head, (self.num_kv_heads or heads) * head
        b = int(self.bias)
        hidden = self.mlp_hidden or 4 * d
        norm = 2 * d if self.norm == "layer" else d
        attention = (d * q_width + b * q_width) + 2 * (d * kv_width + b * kv_width) + (q_width * d + b * d)
        if self.mlp == "swiglu":
            mlp = 2 * (d * hidden + b * hidden) + (hidden * d + b * d)
        else:
            mlp = (d * hidden + b * hidden) + (hidden * d + b * d)
        positions = self.seq_len * d if self.position == "learned" else 0
        logits = 0 if self.tie_embeddings else self.vocab_size * (d + int(self.logits_bias))
        return self.vocab_size * d + positions + self.num_layers * (2 * norm + attention + mlp) + norm + logits


@describe
def GPT(cfg: GPTConfig = GPTConfig()) -> Layer:
    """Token embeddings, [learned position embeddings], `num_layers` causal pre-norm blocks, a final norm and
    next-token logits (from the embedding table with `tie_embeddings`).

    Input: (B, T) integer token ids; output: (B, T, vocab_size) logits for the next token. Decodes with a KV cache
    (`jaxnn.generate`). With `position="learned"` sequences are at most `seq_len` long; with "rope" any length.
    """
    block = TransformerBlock(
        cfg.num_heads,
        mlp_hidden=cfg.mlp_hidden,
        mlp=cfg.mlp,
        drop_prob=cfg.drop_prob,
        causal=True,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope=cfg.position == "rope",
        rope_base=cfg.rope_base,
        norm=cfg.norm,
        norm_eps=cfg.norm_eps,
        bias=cfg.bias,
        attention_implementation=cfg.attention_implementation,
    )
    if cfg.remat:
        block = remat(block, checkpoint_policy=None if cfg.remat is True else cfg.remat)
    blocks = [Repeat(block, cfg.num_layers, name="blocks")] if cfg.scan_layers else [block] * cfg.num_layers
    positions = [PositionEmbedding(cfg.seq_len)] if cfg.position == "learned" else []
    Norm = LayerNorm if cfg.norm == "layer" else RMSNorm
    body = [
        Embedding(cfg.vocab_size, cfg.d_model, init_scale=0.02),
        *positions,
        *blocks,
        Norm(cfg.norm_eps, name="ln_f"),
    ]
    if cfg.tie_embeddings:
        return tied_logits(serial(*body, name="gpt"))
    return serial(*body, Dense(cfg.vocab_size, use_bias=cfg.logits_bias, name="logits"), name="gpt")


def tied_logits(body: Layer) -> Layer:
    """`body` (an Embedding first, hidden states out) followed by logits against the embedding table itself:
    `h @ table.T`, so the input and output vocabularies share one matrix (GPT-2's weight tying)."""
    embed_key = f"0_{body.children[0].name}"

    def apply(params, ids, *, policy=None, **kwargs):
        out = body.apply(params, ids, policy=policy, **kwargs)
        hidden, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        # The transpose folds into the product's contraction: XLA reads the (V, D) table in place.
        logits = precision.dense(hidden, params[embed_key]["table"].T, policy).astype(hidden.dtype)
        return (logits, *rest) if rest else logits

    def init(key, in_shape):
        out_shape, params = body.init(key, in_shape)
        return (*out_shape[:-1], params[embed_key]["table"].shape[0]), params

    return body._replace(init=init, apply=apply)


def _gpt2(d_model: int, num_layers: int, num_heads: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=50257,
        seq_len=1024,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        tie_embeddings=True,
        norm_eps=1e-5,
    )


def _llama(vocab: int, d_model: int, layers: int, heads: int, kv_heads: int, hidden: int, **fields) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab,
        d_model=d_model,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        mlp_hidden=hidden,
        position="rope",
        norm="rms",
        mlp="swiglu",
        bias=False,
        norm_eps=1e-5,
        **fields,
    )


# name -> (config, the published parameter count, what it is). Llama 3's rotary scaling for long contexts is not
# modelled: the presets have those models' shapes and counts, at their pre-training context length.
PRESETS: dict[str, tuple[GPTConfig, int, str]] = {
    "gpt2": (_gpt2(768, 12, 12), 124_439_808, "GPT-2 small (OpenAI, 2019): 12 x 768, tied embeddings"),
    "gpt2-medium": (_gpt2(1024, 24, 16), 354_823_168, "GPT-2 medium: 24 x 1024"),
    "gpt2-large": (_gpt2(1280, 36, 20), 774_030_080, "GPT-2 large: 36 x 1280"),
    "gpt2-xl": (_gpt2(1600, 48, 25), 1_557_611_200, "GPT-2 XL: 48 x 1600"),
    "tinyllama-1.1b": (
        _llama(32000, 2048, 22, 32, 4, 5632, seq_len=2048),
        1_100_048_384,
        "TinyLlama 1.1B: Llama 2 architecture, 22 x 2048, 4 key/value heads",
    ),
    "llama-3.2-1b": (
        _llama(128256, 2048, 16, 32, 8, 8192, seq_len=8192, rope_base=500000.0, tie_embeddings=True),
        1_235_814_400,
        "Llama 3.2 1B (Meta): 16 x 2048, 8 key/value heads, tied embeddings",
    ),
    "llama-2-7b": (
        _llama(32000, 4096, 32, 32, 32, 11008, seq_len=4096),
        6_738_415_616,
        "Llama 2 7B (Meta): 32 x 4096, multi-head attention",
    ),
    "llama-3-8b": (
        _llama(128256, 4096, 32, 32, 8, 14336, seq_len=8192, rope_base=500000.0),
        8_030_261_248,
        "Llama 3 8B (Meta): 32 x 4096, 8 key/value heads",
    ),
}
