"""The ViT is torchvision's: a small torchvision VisionTransformer's weights, mapped tensor by tensor, give its
logits (the patch layout, class token, position rows, pre-norm blocks, exact GELU and LayerNorm eps all show)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn.interop.torchvision import load_torchvision_vit, vit_config_from_state_dict, vit_to_torchvision_state_dict
from jaxnn.models.vit import ViT, ViTConfig

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

CFG = ViTConfig().small()


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
    head_dim = CFG.hidden_dim // CFG.num_heads
    assert vit_config_from_state_dict(tensors, head_dim=head_dim) == CFG  # every size read off the weights
    model = ViT(CFG)
    params = load_torchvision_vit(reference.state_dict(), CFG)
    x = 0.01 * np.random.default_rng(0).normal(size=(2, 3, CFG.image_size, CFG.image_size)).astype(np.float32)
    with torch.no_grad():
        want = reference.eval()(torch.from_numpy(x)).numpy()
    got = jax.jit(model.apply)(params, jnp.asarray(x.transpose(0, 2, 3, 1)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert got.shape == want.shape == (2, CFG.num_classes)
    # float32 rounding stays near 1e-7 of the largest logit; the tanh GELU, or LayerNorm eps 1e-5 instead of 1e-6,
    # moves the logits by 1e-4 of it and more.
    assert err < 1e-5 * float(np.abs(want).max()), f"max abs error {err:.3g} (logits up to {np.abs(want).max():.3g})"

    back = torchvision.models.VisionTransformer(
        CFG.image_size, CFG.patch_size, CFG.num_layers, CFG.num_heads, CFG.hidden_dim, CFG.mlp_dim,
        num_classes=CFG.num_classes,
    )  # fmt: skip
    back.load_state_dict({k: torch.from_numpy(v) for k, v in vit_to_torchvision_state_dict(params, CFG).items()})
    with torch.no_grad():
        np.testing.assert_array_equal(back.eval()(torch.from_numpy(x)).numpy(), want)
