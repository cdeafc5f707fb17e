"""The ViT is torchvision's: a small torchvision VisionTransformer's weights, mapped tensor by tensor, give its
logits (the patch layout, class token, position rows, pre-norm blocks, exact GELU and LayerNorm eps all show)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn.interop.tensors import Rule, same, to_jaxnn, transposed
from jaxnn.models.vit import ViT, ViTConfig

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

CFG = ViTConfig().small()


def conv(source, target):
    return Rule((source,), target, lambda a: a.transpose(2, 3, 1, 0))


def block_rules(i):
    src, dst = f"encoder.layers.encoder_layer_{i}", ("3_encoder", f"{i + 1}_block")
    attn, mlp = (*dst, "0_attn"), (*dst, "1_mlp")
    return [
        same(f"{src}.ln_1.weight", (*attn, "0_ln_1", "scale")),
        same(f"{src}.ln_1.bias", (*attn, "0_ln_1", "bias")),
        transposed(f"{src}.self_attention.in_proj_weight", (*attn, "1_self_attention", "qkv", "w")),
        same(f"{src}.self_attention.in_proj_bias", (*attn, "1_self_attention", "qkv", "b")),
        transposed(f"{src}.self_attention.out_proj.weight", (*attn, "1_self_attention", "out", "w")),
        same(f"{src}.self_attention.out_proj.bias", (*attn, "1_self_attention", "out", "b")),
        same(f"{src}.ln_2.weight", (*mlp, "0_ln_2", "scale")),
        same(f"{src}.ln_2.bias", (*mlp, "0_ln_2", "bias")),
        transposed(f"{src}.mlp.0.weight", (*mlp, "1_fc1", "w")),
        same(f"{src}.mlp.0.bias", (*mlp, "1_fc1", "b")),
        transposed(f"{src}.mlp.3.weight", (*mlp, "4_fc2", "w")),
        same(f"{src}.mlp.3.bias", (*mlp, "4_fc2", "b")),
    ]


def vit_rules(cfg):
    return [
        conv("conv_proj.weight", ("0_conv_proj", "w")),
        same("conv_proj.bias", ("0_conv_proj", "b")),
        same("class_token", ("2_embed", "class_token")),
        same("encoder.pos_embedding", ("2_embed", "pos_embedding")),
        *(rule for i in range(cfg.num_layers) for rule in block_rules(i)),
        same("encoder.ln.weight", ("3_encoder", f"{cfg.num_layers + 1}_ln", "scale")),
        same("encoder.ln.bias", ("3_encoder", f"{cfg.num_layers + 1}_ln", "bias")),
        transposed("heads.head.weight", ("5_head", "w")),
        same("heads.head.bias", ("5_head", "b")),
    ]


def test_vit_gives_torchvisions_logits():
    torch.manual_seed(0)
    reference = torchvision.models.VisionTransformer(
        CFG.image_size,
        CFG.patch_size,
        CFG.num_layers,
        CFG.num_heads,
        CFG.hidden_dim,
        CFG.mlp_dim,
        num_classes=CFG.num_classes,
    )
    with torch.no_grad():
        for name, p in reference.named_parameters():  # torchvision zeros the head and the class token
            # Small embeddings and images: the first LayerNorm sees a variance of ~1e-4, where its eps shows.
            p.copy_(torch.randn(p.shape) * (0.01 if name in ("class_token", "encoder.pos_embedding") else 0.5))
    tensors = {k: v.numpy() for k, v in reference.state_dict().items()}
    model = ViT(CFG)
    shape = (2, CFG.image_size, CFG.image_size, 3)
    expected = jax.eval_shape(lambda k: model.init(k, shape)[1], jax.random.key(0))
    params = to_jaxnn(tensors, vit_rules(CFG), expected, source="torchvision ViT")
    x = 0.01 * np.random.default_rng(0).normal(size=(2, 3, CFG.image_size, CFG.image_size)).astype(np.float32)
    with torch.no_grad():
        want = reference.eval()(torch.from_numpy(x)).numpy()
    got = jax.jit(model.apply)(params, jnp.asarray(x.transpose(0, 2, 3, 1)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert got.shape == want.shape == (2, CFG.num_classes)
    # float32 rounding stays near 1e-7 of the largest logit; the tanh GELU, or LayerNorm eps 1e-5 instead of 1e-6,
    # moves the logits by 1e-4 of it and more.
    assert err < 1e-5 * float(np.abs(want).max()), f"max abs error {err:.3g} (logits up to {np.abs(want).max():.3g})"
