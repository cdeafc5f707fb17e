"""The vision families' presets have the parameter counts torchvision publishes for them (counted from the param
tree's shapes with jax.eval_shape: nothing is allocated), and their small configs build and run."""

import math

import jax
import jax.numpy as jnp
import pytest

from jaxnn import layers as L
from jaxnn.models import get_model, imagenet_resnet, vit
from jaxnn.models.factory import build_model
from jaxnn.models.presets import PRESETS as TABLE

VISION = ("imagenet_resnet", "vit")
PRESETS = [
    pytest.param(p.family, p.config, p.published_params, id=name) for name, p in TABLE.items() if p.family in VISION
]


def param_count(model, in_shape) -> int:
    shapes = jax.eval_shape(lambda key: model.init(key, in_shape)[1], jax.random.key(0))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


@pytest.mark.parametrize("family, cfg, published", PRESETS)
def test_preset_has_the_published_parameter_count(family, cfg, published):
    assert param_count(get_model(family, cfg), (1, 224, 224, 3)) == published


def test_presets_are_in_the_table_and_build_with_fields_replaced():
    assert sorted(name for name, p in TABLE.items() if p.family in VISION) == [
        "resnet18",
        "resnet34",
        "resnet50",
        "vit-b16",
        "vit-l16",
    ]
    _, cfg = build_model("resnet50", {"num_classes": 7})
    assert cfg == imagenet_resnet.ImageNetResNetConfig(stage_sizes=(3, 4, 6, 3), block="bottleneck", num_classes=7)


@pytest.mark.parametrize("family", ["imagenet_resnet", "vit"])
@pytest.mark.slow
def test_small_vision_models_train(family, key):
    """Train mode (eval mode is what the torchvision comparisons run): logits, and BatchNorm statistics that move."""
    cfg = {"imagenet_resnet": imagenet_resnet.ImageNetResNetConfig, "vit": vit.ViTConfig}[family]().small()
    model = get_model(family, cfg)
    shape = (2, 32, 32, 3)
    out_shape, params, state = L.init_model(model, key, shape)
    y, new_state = jax.jit(lambda p, s, x: L.run(model, p, x, state=s, train=True))(
        params, state, jax.random.normal(key, shape)
    )
    assert y.shape == tuple(out_shape) == (2, 10) and bool(jnp.all(jnp.isfinite(y)))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    moved = [bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state))]
    assert all(moved) and (len(moved) > 0) == (family == "imagenet_resnet")


def test_vision_configs_refuse_what_they_cannot_build():
    with pytest.raises(ValueError, match=r"ImageNetResNetConfig: unknown block 'wide'"):
        imagenet_resnet.ImageNetResNetConfig(block="wide")
    with pytest.raises(ValueError, match=r"ViTConfig: image_size 30 is not a multiple of patch_size 8"):
        vit.ViTConfig(image_size=30, patch_size=8)
    model = vit.ViT(vit.ViTConfig().small())
    with pytest.raises(L.LayerError, match=r"embed: expected input \(batch, 16 patches, features\), got shape"):
        model.init(jax.random.key(0), (1, 64, 64, 3))
