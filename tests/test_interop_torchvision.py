"""torchvision ResNets in and out of jaxnn: a torchvision resnet18 with random weights and random BatchNorm
statistics, saved with torch.save, loads into `ImageNetResNet` and gives torchvision's eval-mode logits; the
conversion back loads into torchvision and gives them again; broken state dicts fail naming the tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn.interop.tensors import TensorMismatchError
from jaxnn.models.imagenet_resnet import ImageNetResNet, ImageNetResNetConfig

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from jaxnn.interop.torchvision import (  # noqa: E402  (only where torch is)
    load_torchvision_resnet,
    resnet_config_from_state_dict,
    to_torchvision_state_dict,
)

RESNET18 = ImageNetResNetConfig()
# float32 rounding through 20 convolutions of up to 4608 terms, logits up to ~3.6 (one ulp there: 2.4e-7): measured
# 2.4e-6, 2e-5 leaves 8x room. A wrong layout, padding or BatchNorm statistic moves them by 1e-1 and more (unit
# BatchNorm statistics instead of the checkpoint's: 3.5).
ATOL = 2e-5


def randomised(model):
    """`model` with random weights and random positive BatchNorm statistics, so eval mode really reads them."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if name.endswith("bias") else 1 / p[0].numel() ** 0.5))
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen) * 0.1)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def torch_model():
    return randomised(torchvision.models.resnet18())


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).normal(size=(2, 3, 64, 64)).astype(np.float32)  # NCHW, as torch takes them


@pytest.fixture(scope="module")
def torch_logits(torch_model, images):
    with torch.no_grad():
        return torch_model(torch.from_numpy(images)).numpy()


@pytest.fixture(scope="module")
def checkpoint(torch_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("torchvision") / "resnet18.pth"
    torch.save(torch_model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def forward():
    model = ImageNetResNet(RESNET18)
    return jax.jit(lambda params, state, x: model.apply(params, x, state=state)[0])


def max_error(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def test_loaded_resnet18_gives_torchvisions_eval_logits(checkpoint, images, torch_logits, forward):
    params, state = load_torchvision_resnet(checkpoint)  # the config read off the tensor names
    logits = forward(params, state, jnp.asarray(images.transpose(0, 2, 3, 1)))  # NHWC
    assert logits.shape == torch_logits.shape == (2, 1000)
    err = max_error(logits, torch_logits)
    assert err < ATOL, (
        f"max abs error {err:.3g} against torchvision's eval logits (scale {np.abs(torch_logits).max():.3g})"
    )


def test_state_dict_round_trips_into_torchvision(checkpoint, images, torch_logits):
    params, state = load_torchvision_resnet(checkpoint, RESNET18)
    exported = to_torchvision_state_dict(params, state, RESNET18)
    model = torchvision.models.resnet18()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()})  # strict: every key
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(images)).numpy()
    assert max_error(logits, torch_logits) == 0.0, "the round trip changed a tensor"
    original = torch.load(checkpoint, weights_only=True)
    assert set(exported) == set(original)


def test_safetensors_file_loads_the_same(checkpoint, torch_model, tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "resnet18.safetensors"
    save_file({k: v.numpy() for k, v in torch_model.state_dict().items()}, str(path))
    from_pth, from_safetensors = load_torchvision_resnet(checkpoint), load_torchvision_resnet(path)
    assert jax.tree.structure(from_pth) == jax.tree.structure(from_safetensors)
    for a, b in zip(jax.tree.leaves(from_pth), jax.tree.leaves(from_safetensors)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_bottleneck_resnet_gives_torchvisions_eval_logits():
    """ResNet-50's blocks (v1.5 strides, a projection in the first stage too), one per stage to stay small."""
    from torchvision.models.resnet import Bottleneck, ResNet

    reference = randomised(ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10))
    x = np.random.default_rng(1).normal(size=(2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        want = reference(torch.from_numpy(x)).numpy()
    params, state = load_torchvision_resnet(reference.state_dict())
    cfg = ImageNetResNetConfig(stage_sizes=(1, 1, 1, 1), block="bottleneck", num_classes=10)
    got = jax.jit(ImageNetResNet(cfg).apply)(params, jnp.asarray(x.transpose(0, 2, 3, 1)), state=state)[0]
    err = max_error(got, want)
    assert err < ATOL, f"max abs error {err:.3g} (logits up to {np.abs(want).max():.3g})"


def test_config_is_read_off_the_tensor_names():
    resnet50 = torchvision.models.resnet50(num_classes=7).state_dict()
    assert resnet_config_from_state_dict(resnet50) == ImageNetResNetConfig(
        stage_sizes=(3, 4, 6, 3), block="bottleneck", num_classes=7
    )
    assert resnet_config_from_state_dict(torchvision.models.resnet34().state_dict()).stage_sizes == (3, 4, 6, 3)


@pytest.mark.slow
def test_bfloat16_load_gives_bfloat16_params(torch_model, images, torch_logits, forward):
    params, state = load_torchvision_resnet(torch_model.state_dict(), RESNET18, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}  # statistics stay exact
    logits = forward(params, state, jnp.asarray(images.transpose(0, 2, 3, 1), jnp.bfloat16))
    err = max_error(logits, torch_logits)
    assert logits.dtype == jnp.bfloat16 and err < 0.1 * np.abs(torch_logits).max(), f"max abs error {err:.3g}"


@pytest.fixture
def state_dict(torch_model):
    return {k: v.numpy() for k, v in torch_model.state_dict().items()}


def test_missing_tensor_is_named(state_dict):
    del state_dict["layer3.0.downsample.1.running_var"]
    with pytest.raises(TensorMismatchError, match=r"missing tensor 'layer3.0.downsample.1.running_var' \(1 missing"):
        load_torchvision_resnet(state_dict, RESNET18)


def test_unexpected_tensor_is_named(state_dict):
    state_dict["layer2.0.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(TensorMismatchError, match=r"unexpected tensor 'layer2.0.extra.weight' \(1 unexpected"):
        load_torchvision_resnet(state_dict, RESNET18)


def test_wrong_shape_is_named(state_dict):
    state_dict["layer1.1.conv2.weight"] = np.zeros((64, 64, 1, 1), np.float32)
    message = (
        r"layer1.1.conv2.weight has shape \(1, 1, 64, 64\) as jaxnn's params/4_layer1/1_block/0_body/3_conv2/w, "
        r"which the model needs as \(3, 3, 64, 64\)"
    )
    with pytest.raises(TensorMismatchError, match=message):
        load_torchvision_resnet(state_dict, RESNET18)


def test_a_state_dict_that_is_no_resnet_is_refused():
    with pytest.raises(TensorMismatchError, match=r"not a torchvision ResNet state dict: no 'conv1.weight'"):
        load_torchvision_resnet({"weight": np.zeros(3, np.float32)})


def test_shapes_read_from_headers_match_the_tensors_and_give_the_same_config(checkpoint, torch_model, tmp_path):
    from safetensors.numpy import save_file

    from jaxnn.interop.tensors import read_tensor_shapes, read_tensors

    path = tmp_path / "resnet18.safetensors"
    save_file({k: v.numpy() for k, v in torch_model.state_dict().items()}, str(path))
    for source in (checkpoint, path):
        shapes, tensors = read_tensor_shapes(source), read_tensors(source)
        assert {k: np.shape(v) for k, v in shapes.items()} == {k: np.shape(v) for k, v in tensors.items()}
        assert all(v.nbytes == 0 or v.strides == (0,) * v.ndim for v in shapes.values())  # no data was read
        assert resnet_config_from_state_dict(shapes) == resnet_config_from_state_dict(tensors) == RESNET18
