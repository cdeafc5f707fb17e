"""The pre-norm transformer block and the MLPs it holds (a GELU MLP, `SwiGLU`), built from
`jaxnn.layers.attention.MultiHeadAttention`, norms and dense layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.nn import initializers

from jaxnn.layers.activation import Dropout, Gelu
from jaxnn.layers.attention import MultiHeadAttention
from jaxnn.layers.combinators import Lambda, residual, serial
from jaxnn.layers.core import Layer, check_keywords, check_positive, describe, shape_error, with_name
from jaxnn.layers.core import init_cache as init_cache_of
from jaxnn.layers.linear import Dense
from jaxnn.layers.norm import LayerNorm, RMSNorm
from jaxnn.layers.stack import remat_layer, remat_policy
from jaxnn.parallel.activations import BATCH, HIDDEN, constrain

NORMS = ("layer", "rms")
MLPS = ("gelu", "swiglu")


# Gelu with the MLP's hidden width pinned to `tensor` where a mesh is set (`jaxnn.parallel.activations`): the Megatron
# layout between the column- and row-parallel projections, which propagation alone does not always keep.
HiddenGelu = Lambda(lambda x: constrain(Gelu.apply({}, x), (BATCH, None, HIDDEN)), "gelu")


@describe
def SwiGLU(
    hidden_features: int,
    *,
    use_bias: bool = False,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    name: str = "swiglu",
) -> Layer:
    """The gated MLP of Llama and PaLM: `down(silu(gate(x)) * up(x))`, back to the input's width.

    Params `gate` and `up` (D, hidden) and `down` (hidden, D), each a Dense (biases only with `use_bias`); the
    built-in sharding rules split gate and up by columns and down by rows, as for a GELU MLP's fc and proj."""
    check_positive("SwiGLU", hidden_features=hidden_features)

    def dense(features: int, part: str) -> Layer:
        return Dense(features, use_bias=use_bias, w_init=w_init, name=part)

    def init(key, in_shape):
        if len(in_shape) < 1:
            raise shape_error(name, "of rank >= 1", in_shape)
        k_gate, k_up, k_down = jax.random.split(key, 3)
        hidden_shape = (*in_shape[:-1], hidden_features)
        params = {
            "gate": dense(hidden_features, "gate").init(k_gate, in_shape)[1],
            "up": dense(hidden_features, "up").init(k_up, in_shape)[1],
            "down": dense(in_shape[-1], "down").init(k_down, hidden_shape)[1],
        }
        return tuple(in_shape), params

    def apply(params, x, *, policy=None, **kwargs):
        check_keywords(name, kwargs)
        gate = dense(hidden_features, "gate").apply(params["gate"], x, policy=policy)
        up = dense(hidden_features, "up").apply(params["up"], x, policy=policy)
        hidden = constrain(jax.nn.silu(gate) * up, (BATCH, None, HIDDEN)) if x.ndim == 3 else jax.nn.silu(gate) * up
        return dense(x.shape[-1], "down").apply(params["down"], hidden, policy=policy)

    return Layer(init, with_name(name, apply), name)


def _mlp(kind: str, hidden: int, bias: bool, w_init: initializers.Initializer, width: int) -> list[Layer]:
    """The block's MLP sublayers after its norm: a GELU MLP (fc, gelu, proj) or a SwiGLU."""
    if kind == "swiglu":
        return [SwiGLU(hidden, use_bias=bias, w_init=w_init)]
    return [
        Dense(hidden, use_bias=bias, w_init=w_init, name="fc"),
        HiddenGelu,
        Dense(width, use_bias=bias, w_init=w_init, name="proj"),
    ]


def _check_block(mlp_ratio, mlp_hidden, mlp, norm, norm_eps, drop_prob) -> None:
    """Refuses a bad TransformerBlock construction in one line, before any init."""
    check_positive("TransformerBlock", mlp_ratio=mlp_ratio)
    if mlp_hidden is not None:
        check_positive("TransformerBlock", mlp_hidden=mlp_hidden)
    if norm not in NORMS:
        raise ValueError(f"TransformerBlock: unknown norm {norm!r}; choose one of {NORMS}")
    if mlp not in MLPS:
        raise ValueError(f"TransformerBlock: unknown mlp {mlp!r}; choose one of {MLPS}")
    Dropout(drop_prob)  # each layer's own check of its argument
    (LayerNorm if norm == "layer" else RMSNorm)(norm_eps)


def _built_per_width(name: str, build: Callable[[int], Layer]) -> tuple[Callable, Callable, Callable]:
    """`init`, `apply` and `init_cache` of a (batch, time, features) layer that is `build(features)`."""

    def init(key, in_shape):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        return build(in_shape[-1]).init(key, in_shape)

    def apply(params, x, **kwargs):
        if x.ndim != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", x.shape)
        return build(x.shape[-1]).apply(params, constrain(x, (BATCH, None, None)), **kwargs)

    def init_cache(in_shape, max_len, dtype):
        return init_cache_of(build(in_shape[-1]), in_shape, max_len, dtype)

    return init, apply, init_cache


@describe
def TransformerBlock(
    num_heads: int,
    *,
    mlp_ratio: int = 4,
    mlp_hidden: int | None = None,
    mlp: str = "gelu",
    drop_prob: float = 0.0,
    causal: bool = True,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    norm: str = "layer",
    norm_eps: float = 1e-6,
    bias: bool = True,
    cross_attention: bool = False,
    context_features: int | None = None,
    attention_implementation: str = "auto",
    w_init: initializers.Initializer = initializers.lecun_normal(),
    remat: Any = None,
    name: str = "block",
) -> Layer:
    """Pre-norm transformer block: x + Attention(Norm(x)), [x + CrossAttention(Norm(x), context)],
    then x + MLP(Norm(x)).

    The MLP: `mlp="gelu"` (fc, tanh-GELU, proj; GPT-2) or "swiglu" (`SwiGLU`; Llama), of hidden width
    `mlp_hidden` (default mlp_ratio * D). `norm`: "layer" (LayerNorm) or "rms" (RMSNorm), with epsilon
    `norm_eps`; `bias=False` leaves out every projection's bias; `num_kv_heads`, `head_dim`, `rope` and
    `rope_base` as in `MultiHeadAttention`; `w_init` initialises every projection (attention and MLP);
    `cross_attention=True` adds a cross-attention sublayer reading the `context` side input (an encoder-decoder
    block). Side inputs (mask, positions, context, context_mask) reach the sublayers that read them; a causal block
    decodes with a cache. `remat`: recompute the block's activations in the backward pass under this policy
    (`jaxnn.layers.remat`: "nothing", "dots", "dots_no_batch", "everything", "offload").
    """
    _check_block(mlp_ratio, mlp_hidden, mlp, norm, norm_eps, drop_prob)
    remat_policy(remat)  # an unknown name is refused here, not at the first call
    Norm = LayerNorm if norm == "layer" else RMSNorm

    def attention(cross: bool) -> Layer:
        return MultiHeadAttention(
            num_heads,
            head_dim,
            num_kv_heads=num_kv_heads,
            causal=causal and not cross,
            rope=rope and not cross,
            rope_base=rope_base,
            cross=cross,
            context_features=context_features,
            implementation=attention_implementation,
            bias=bias,
            w_init=w_init,
            name="cross_attention" if cross else "attention",
        )

    def pre_norm(layers: list[Layer], part: str) -> Layer:
        return residual(Norm(norm_eps, name="ln"), *layers, Dropout(drop_prob), name=part)

    def build(width: int) -> Layer:
        sublayers = [pre_norm([attention(False)], "attn")]
        if cross_attention:
            sublayers.append(pre_norm([attention(True)], "cross"))
        sublayers.append(pre_norm(_mlp(mlp, mlp_hidden or mlp_ratio * width, bias, w_init, width), "mlp"))
        block = serial(*sublayers, name=name)
        return block if remat is None else remat_layer(block, checkpoint_policy=remat)

    template = build(1)  # the sublayers' side inputs and cache do not depend on the width
    init, apply, init_cache = _built_per_width(name, build)
    decodes = template.init_cache is not None
    return Layer(
        init,
        apply,
        name,
        side_inputs=template.side_inputs,
        init_cache=init_cache if decodes else None,
        expands=lambda in_shape: (build(in_shape[-1]), 1),
    )
