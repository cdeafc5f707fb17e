"""3-D and transposed convolutions, GroupNorm and InstanceNorm: parity with Flax Linen given the same weights, the
initialisers, and the one-line errors every apply raises for an input it cannot take."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.nn import initializers

from jaxnn import layers as L
from jaxnn.layers.core import LayerError, LayerTypeError

TOL = {"rtol": 2e-5, "atol": 2e-5}


def random_like(tree, seed=1):
    """Fresh random values (not the initialisers' zeros and ones) so every parameter matters; drawn by numpy, since
    each eager jax.random call of a new shape costs a compile on this CPU."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(x.dtype), tree)


def normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def zero_params(layer, shape):
    """Parameters of the right structure as numpy zeros: the error tests need shapes, not an eager init's compiles."""
    params = jax.eval_shape(lambda k: layer.init(k, shape)[1], jax.random.key(0))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params)


def flax_conv_params(params):
    return {"params": {"kernel": params["w"], "bias": params["b"]}}


@pytest.mark.parametrize("lowering", ["auto", "xla"])
def test_conv3d_matches_flax(lowering):
    kwargs = {"features": 3, "kernel_size": (2, 3, 2), "strides": (1, 2, 1), "padding": ((1, 0), (1, 1), (0, 1))}
    ours = L.Conv(3, (2, 3, 2), strides=(1, 2, 1), padding=kwargs["padding"], lowering=lowering)
    shape = (2, 3, 5, 4, 2)
    x = normal(shape)
    params = random_like(zero_params(ours, shape))
    flax_y = jax.jit(nn.Conv(**kwargs).apply)(flax_conv_params(params), x)
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x), flax_y, **TOL)


@pytest.mark.parametrize(
    "kernel, strides, padding, dilation, shape",
    [
        ((3,), 2, "SAME", 1, (2, 5, 2)),
        ((3, 3), 2, "VALID", 1, (2, 4, 4, 2)),
        ((2, 2), 3, "SAME", 1, (1, 3, 3, 2)),  # stride above the kernel: flax pads kernel - 1 before
        ((3, 2), (2, 1), ((1, 0), (2, 1)), 1, (1, 4, 3, 2)),
        ((3, 3), 1, 1, 2, (1, 5, 5, 2)),
        ((2, 3, 2), (2, 1, 2), "SAME", 1, (1, 3, 3, 2, 2)),
    ],
)
def test_conv_transpose_matches_flax(kernel, strides, padding, dilation, shape):
    ours = L.ConvTranspose(3, kernel, strides=strides, padding=padding, dilation=dilation)
    rank = len(kernel)
    theirs = nn.ConvTranspose(
        3,
        kernel,
        strides=(strides,) * rank if isinstance(strides, int) else strides,
        padding=padding,
        kernel_dilation=(dilation,) * rank,
    )
    x = normal(shape)
    params = random_like(zero_params(ours, shape))
    y = jax.jit(ours.apply)(params, x)
    assert y.shape == L.output_shape(ours, shape)
    np.testing.assert_allclose(y, jax.jit(theirs.apply)(flax_conv_params(params), x), **TOL)


@pytest.mark.parametrize(
    "ours, theirs, shape",
    [
        (L.GroupNorm(3), nn.GroupNorm(num_groups=3), (2, 3, 3, 6)),
        (L.GroupNorm(group_size=2), nn.GroupNorm(num_groups=None, group_size=2), (2, 5, 4)),
        (L.GroupNorm(4), nn.GroupNorm(num_groups=4), (3, 8)),
        (L.InstanceNorm(), nn.InstanceNorm(), (2, 4, 3, 3)),
        (L.InstanceNorm(), nn.InstanceNorm(), (2, 6, 4)),
    ],
    ids=["group_norm_4d", "group_norm_size_3d", "group_norm_2d", "instance_norm_4d", "instance_norm_3d"],
)
def test_group_and_instance_norm_match_flax(ours, theirs, shape):
    x = normal(shape) * 2 + 0.5
    params = random_like(zero_params(ours, shape))
    flax_y = jax.jit(theirs.apply)({"params": params}, x)
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x), flax_y, **TOL)


def test_norm_initialisers_are_selectable(key):
    two, minus_one = initializers.constant(2.0), initializers.constant(-1.0)
    for layer in (
        L.LayerNorm(scale_init=two, bias_init=minus_one),
        L.BatchNorm(scale_init=two, bias_init=minus_one),
        L.GroupNorm(2, scale_init=two, bias_init=minus_one),
        L.InstanceNorm(scale_init=two, bias_init=minus_one),
    ):
        _, params = layer.init(key, (2, 3, 4))
        assert params["scale"].tolist() == [2.0] * 4 and params["bias"].tolist() == [-1.0] * 4, layer.name
    assert L.RMSNorm(scale_init=two).init(key, (2, 4))[1]["scale"].tolist() == [2.0] * 4
    _, params = L.GroupNorm(2).init(key, (2, 4))
    assert params["scale"].tolist() == [1.0] * 4 and params["bias"].tolist() == [0.0] * 4


@pytest.mark.parametrize("layer", [L.Conv(4, 3), L.ConvTranspose(4, 3, strides=2)], ids=["conv", "conv_transpose"])
def test_integer_input_is_refused(layer):
    shape = (2, 5, 5, 3)
    x = np.zeros(shape, np.uint8)
    with pytest.raises(
        LayerTypeError, match=rf"^{layer.name}: expected a floating-point input, got dtype uint8; normalise"
    ):
        layer.apply(zero_params(layer, shape), x)


@pytest.mark.parametrize(
    "layer, w_shape",
    [(L.Conv(4, 3), (3, 3, 5, 4)), (L.ConvTranspose(4, (2, 2, 2), strides=2), (2, 2, 2, 5, 4))],
    ids=["conv", "conv_transpose"],
)
def test_params_of_another_width_are_refused(layer, w_shape):
    in_shape = (2, *([4] * (len(w_shape) - 2)), 3)
    x = np.zeros((*in_shape[:-1], 5), np.float32)
    made_for = (*w_shape[:-2], 3, 4)
    message = rf"^{layer.name}: parameter 'w' has shape {re_shape(made_for)}, this layer needs {re_shape(w_shape)}"
    with pytest.raises(LayerError, match=message):
        layer.apply(zero_params(layer, in_shape), x)


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize(
    "layer, good_shape, x_shape, message",
    [
        (L.Conv(3, 5, padding="VALID"), (2, 8, 8, 1), (2, 3, 3, 1), r"large enough for kernel \(5, 5\)"),
        (
            L.Conv(3, (2, 2, 2), padding="VALID"),
            (2, 4, 4, 4, 1),
            (2, 1, 4, 4, 1),
            r"large enough for kernel \(2, 2, 2\)",
        ),
        (L.Conv(3, 5), (2, 8, 8, 1), (2, 8, 1), r"of rank 4 \(NHWC\)"),
        (L.ConvTranspose(3, (3,), padding=0), (2, 4, 1), (2, 1, 1), r"large enough for kernel \(3,\)"),
        (L.MaxPool(3), (2, 8, 8, 1), (2, 2, 8, 1), r"with spatial sizes >= window \(3, 3\)"),
        (L.AvgPool(2), (2, 8, 8, 1), (2, 8, 1), r"of rank 4"),
        (L.GlobalAvgPool(), (2, 8, 8, 1), (2, 8), r"of rank >= 3"),
        (L.InstanceNorm(), (2, 8, 1), (2, 1), r"of rank >= 3"),
    ],
)
def test_inputs_a_layer_cannot_take_are_refused_at_apply(layer, good_shape, x_shape, message):
    """Params built for a good input; the bad one comes only at apply (a model applied to other data)."""
    params = zero_params(layer, good_shape)
    with pytest.raises(LayerError, match=rf"^{layer.name}: expected input {message}.*, got shape {re_shape(x_shape)}$"):
        layer.apply(params, np.zeros(x_shape, np.float32))


@pytest.mark.parametrize(
    "layer",
    [
        L.Conv(2, 3),
        L.ConvTranspose(2, 3),
        L.LayerNorm(),
        L.BatchNorm(),
        L.GroupNorm(1),
        L.MaxPool(2),
        L.GlobalAvgPool(),
    ],
    ids=lambda layer: layer.name,
)
def test_unknown_keyword_is_refused(layer):
    shape = (2, 4, 4, 1)
    _, params, state = jax.eval_shape(lambda k: L.init_model(layer, k, shape), jax.random.key(0))
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params)
    state_kwargs = {"state": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state)} if layer.stateful else {}
    with pytest.raises(TypeError, match=rf"^{layer.name}: apply got unexpected keyword\(s\) trian; it takes key, "):
        layer.apply(params, np.zeros(shape, np.float32), trian=True, **state_kwargs)


@pytest.mark.parametrize(
    "layer, shape, message",
    [
        (L.GroupNorm(4), (2, 3, 3, 6), r"with channels divisible by num_groups 4, got shape \(2, 3, 3, 6\)"),
        (L.GroupNorm(group_size=4), (2, 6), r"with channels divisible by group_size 4, got shape \(2, 6\)"),
    ],
)
def test_group_norm_groups_must_divide_channels(layer, shape, message, key):
    with pytest.raises(LayerError, match=rf"^group_norm: expected input {message}$"):
        layer.init(key, shape)
    params = {"scale": np.ones(shape[-1], np.float32), "bias": np.zeros(shape[-1], np.float32)}
    with pytest.raises(LayerError, match=rf"^group_norm: expected input {message}$"):
        layer.apply(params, np.zeros(shape, np.float32))


def test_norm_params_of_another_width_are_refused():
    layer = L.LayerNorm()
    with pytest.raises(LayerError, match=r"^layer_norm: parameter 'scale' has shape \(4,\), this layer needs \(6,\)"):
        layer.apply(zero_params(layer, (2, 4)), np.zeros((2, 6), np.float32))


def test_error_inside_serial_names_the_path():
    """The error names the layer's path within the model, as in the params tree (the combinator, the child's key)."""
    model = L.serial(L.Conv(4, 3), L.Relu, L.GlobalAvgPool())
    params = zero_params(model, (2, 6, 6, 3))
    path = r"^serial/0_conv: "
    with pytest.raises(LayerTypeError, match=path + "expected a floating-point input, got dtype int32"):
        model.apply(params, np.zeros((2, 6, 6, 3), np.int32))
    with pytest.raises(LayerError, match=path + r"parameter 'w' has shape \(3, 3, 3, 4\)"):
        model.apply(params, np.zeros((2, 6, 6, 2), np.float32))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: L.ConvTranspose(3, 3, padding="CAUSAL"), r"ConvTranspose: unknown padding mode 'CAUSAL'"),
        (lambda: L.Conv(3, (3, 3, 3, 3)), r"Conv: kernel_size must have 1, 2 or 3 entries"),
        (lambda: L.GroupNorm(0), r"GroupNorm: num_groups must be a positive integer, got 0"),
        (lambda: L.GroupNorm(8, group_size=4), r"GroupNorm: give num_groups or group_size, not both"),
        (lambda: L.InstanceNorm(eps=0.0), r"InstanceNorm: eps must be positive"),
    ],
)
def test_bad_construction_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
