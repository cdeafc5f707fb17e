"""Vision Transformers (Dosovitskiy et al. 2021) in torchvision's layout (`vit_b_16` and kin): images cut into
patches by a strided convolution, a learned class token, learned position embeddings, pre-norm encoder blocks,
and a linear head on the class token's final vector. Channels last: (N, H, W, 3) -> (N, num_classes).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.nn import initializers

from jaxnn.layers import Conv, Dense, Dropout, GeluExact, Lambda, Layer, LayerNorm, MultiHeadAttention, residual, serial
from jaxnn.layers.core import check_keywords, check_params, describe, shape_error

LN_EPS = 1e-6  # torchvision's ViT LayerNorms (torch's own default is 1e-5)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """A ViT classifier; the default is ViT-B/16 at 224x224 (see `PRESETS` for ViT-L/16).

    `image_size` fixes the number of position embeddings, 1 + (image_size // patch_size)^2, so the model takes
    image_size x image_size inputs only. `dropout` is applied where torchvision applies it (after the position
    embeddings, the attention and each MLP layer); 0 as in torchvision's published models."""

    image_size: int = 224
    patch_size: int = 16
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    mlp_dim: int = 3072
    num_classes: int = 1000
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"ViTConfig: hidden_dim {self.hidden_dim} is not a multiple of num_heads {self.num_heads}")

    @property
    def num_patches(self) -> int:
        """Patches per image: (image_size // patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2

    def small(self) -> ViTConfig:
        """32x32 images in 8x8 patches, two blocks of width 32: the same architecture for tests and smoke runs."""
        return dataclasses.replace(
            self, image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
        )


@describe
def ClassTokenAndPositions(num_positions: int, name: str = "embed") -> Layer:
    """(B, P, D) patch vectors -> (B, 1 + P, D): a learned class token in front, then learned position embeddings
    added. Params are torchvision's shapes: `class_token` (1, 1, D) (zeros at init, as there) and `pos_embedding`
    (1, num_positions, D) (normal, std 0.02); P must be num_positions - 1."""
    expected = f"(batch, {num_positions - 1} patches, features)"

    def check(shape):
        if len(shape) != 3 or shape[1] != num_positions - 1:
            raise shape_error(name, expected, shape)

    def init(key, in_shape):
        check(tuple(in_shape))
        D = in_shape[-1]
        params = {
            "class_token": jnp.zeros((1, 1, D), jnp.float32),
            "pos_embedding": initializers.normal(0.02)(key, (1, num_positions, D), jnp.float32),
        }
        return (in_shape[0], num_positions, D), params

    def apply(params, x, **kwargs):
        check_keywords(name, kwargs)
        check(tuple(x.shape))
        B, _, D = x.shape
        check_params(name, params, {"class_token": (1, 1, D), "pos_embedding": (1, num_positions, D)})
        token = jnp.broadcast_to(params["class_token"].astype(x.dtype), (B, 1, D))
        return jnp.concatenate([token, x], axis=1) + params["pos_embedding"].astype(x.dtype)

    return Layer(init, apply, name)


def encoder_block(cfg: ViTConfig, name: str = "block") -> Layer:
    """torchvision's EncoderBlock: x + Attention(LN(x)), then x + MLP(LN(x)) with an exact-GELU MLP of mlp_dim;
    non-causal, every projection with a bias."""
    attention = residual(
        LayerNorm(LN_EPS, name="ln_1"),
        MultiHeadAttention(cfg.num_heads, name="self_attention"),
        Dropout(cfg.dropout),
        name="attn",
    )
    mlp = residual(
        LayerNorm(LN_EPS, name="ln_2"),
        Dense(cfg.mlp_dim, w_init=initializers.xavier_uniform(), name="fc1"),
        GeluExact,
        Dropout(cfg.dropout),
        Dense(cfg.hidden_dim, w_init=initializers.xavier_uniform(), name="fc2"),
        Dropout(cfg.dropout),
        name="mlp",
    )
    return serial(attention, mlp, name=name)


@describe
def ViT(cfg: ViTConfig = ViTConfig()) -> Layer:
    """Patch embedding, class token and positions, `num_layers` encoder blocks, a final LayerNorm, and a Dense
    head on the class token: (N, image_size, image_size, C) -> (N, num_classes) logits."""
    patches = Conv(cfg.hidden_dim, cfg.patch_size, strides=cfg.patch_size, padding="VALID", name="conv_proj")
    to_sequence = Lambda(
        lambda x: x.reshape(x.shape[0], -1, x.shape[-1]),  # (N, h, w, D) -> (N, h * w, D), rows first as torch
        "patches",
        lambda s: (s[0], s[1] * s[2], s[3]),
    )
    blocks = [encoder_block(cfg) for _ in range(cfg.num_layers)]
    encoder = serial(Dropout(cfg.dropout), *blocks, LayerNorm(LN_EPS, name="ln"), name="encoder")
    class_token = Lambda(lambda x: x[:, 0], "class_token", lambda s: (s[0], s[2]))
    return serial(
        patches,
        to_sequence,
        ClassTokenAndPositions(1 + cfg.num_patches),
        encoder,
        class_token,
        Dense(cfg.num_classes, w_init=initializers.zeros, name="head"),
        name="vit",
    )


# name -> (config, published trainable parameter count (torchvision's model card), description).
PRESETS: dict[str, tuple[ViTConfig, int, str]] = {
    "vit-b16": (ViTConfig(), 86_567_656, "ViT-B/16 (torchvision vit_b_16), 224x224"),
    "vit-l16": (
        ViTConfig(num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
        304_326_632,
        "ViT-L/16 (torchvision vit_l_16), 224x224",
    ),
}

__all__ = ["LN_EPS", "PRESETS", "ClassTokenAndPositions", "ViT", "ViTConfig", "encoder_block"]
