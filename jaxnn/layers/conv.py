"""Convolution and transposed convolution over 1-D (N, W, C), 2-D (N, H, W, C) and 3-D (N, D, H, W, C) inputs,
channels last."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from jaxnn import precision
from jaxnn.kernels import onednn
from jaxnn.layers.activation import activation_fn
from jaxnn.layers.core import (
    Layer,
    Shape,
    along_last_axis,
    check_float_input,
    check_keywords,
    check_params,
    check_positive,
    describe,
    shape_error,
)
from jaxnn.precision import Policy

# What lax takes as padding: "SAME", "VALID", or one (low, high) pair per spatial axis.
Padding: TypeAlias = str | Sequence[tuple[int, int]]

_DIMENSION_NUMBERS = {
    1: ("NWC", "WIO", "NWC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}
PADDING_MODES = ("SAME", "VALID", "CAUSAL")
LOWERINGS = ("auto", "xla", "im2col", "onednn")
# "auto" with the oneDNN kernels switched on keeps im2col for inputs narrower than this (an image stem): oneDNN's
# direct kernels vectorise over channels, and the CNN's 3-channel stem ran at 26 GFLOP/s in fp32 against im2col's
# 40-60; its bf16 weight gradient (0.4 ms) took 114 ms while another process held one of the two cores, where
# im2col's dots slow down in proportion (docs/performance.md, "oneDNN kernels").
ONEDNN_AUTO_MIN_CHANNELS = 8


def _as_tuple(value: int | Sequence[int], rank: int, arg: str, layer: str) -> tuple[int, ...]:
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(values) != rank:
        raise ValueError(f"{layer}: {arg} needs {rank} values, got {value!r}")
    check_positive(layer, **{f"{arg}[{i}]": v for i, v in enumerate(values)})
    return values


def _normalise_padding(
    padding: str | int | Sequence[tuple[int, int]],
    rank: int,
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    layer: str,
) -> Padding:
    """Returns padding in the form lax accepts: "SAME", "VALID", or a list of (low, high) pairs."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode not in PADDING_MODES:
            raise ValueError(
                f"{layer}: unknown padding mode {padding!r}; choose one of {PADDING_MODES}, "
                "an int, or (low, high) pairs"
            )
        if mode == "CAUSAL":
            if rank != 1:
                raise ValueError(f"{layer}: CAUSAL padding is for 1-D convolutions only")
            return [((kernel[0] - 1) * dilation[0], 0)]
        return mode
    if isinstance(padding, int):
        padding = [(padding, padding)] * rank
    pairs = [tuple(p) for p in padding]
    if len(pairs) != rank or any(len(p) != 2 or min(p) < 0 for p in pairs):
        raise ValueError(f"{layer}: padding must be {rank} non-negative (low, high) pairs, got {padding!r}")
    return [(low, high) for low, high in pairs]


def _explicit_pads(pad, in_spatial, kernel, strides, dilation):
    if not isinstance(pad, str):
        return [tuple(p) for p in pad]
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
    return list(lax.padtype_to_pads(in_spatial, dilated, strides, pad))


def conv_im2col(
    x: jax.Array,
    w: jax.Array,
    strides: Sequence[int],
    pad: Padding,
    dilation: Sequence[int],
    policy: Policy | None = None,
) -> jax.Array:
    """A channels-last convolution (no feature groups) as one matmul: the kernel_size taps of the padded input
    are sliced out and concatenated along channels (im2col), then contracted with `w` reshaped to
    (taps * in_channels, features). Gives what `lax.conv_general_dilated` gives, up to summation order.

    Why: XLA's CPU convolution (forward, and above all its input- and weight-gradient convolutions) runs well
    below its matmul rate; here the forward pass and both gradients are plain dots (see docs/performance.md).
    """
    patches = im2col_patches(x, w.shape[:-2], strides, pad, dilation)
    w_flat = w.reshape(-1, w.shape[-1])
    y = precision.einsum("mk,kn->mn", patches.reshape(-1, w_flat.shape[0]), w_flat, policy)
    return y.reshape(*patches.shape[:-1], w_flat.shape[1])


def im2col_patches(
    x: jax.Array, kernel: Sequence[int], strides: Sequence[int], pad: Padding, dilation: Sequence[int]
) -> jax.Array:
    """The kernel taps of the padded input, concatenated along channels: (N, *out_spatial, taps * channels)."""
    spatial = x.shape[1:-1]
    pads = _explicit_pads(pad, spatial, kernel, strides, dilation)
    x = jnp.pad(x, [(0, 0), *pads, (0, 0)])
    out = _conv_spatial(spatial, pad, kernel, strides, dilation)
    taps = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        start = (0, *(o * d for o, d in zip(offsets, dilation)), 0)
        limit = (
            x.shape[0],
            *(o * d + (n - 1) * s + 1 for o, d, n, s in zip(offsets, dilation, out, strides)),
            x.shape[-1],
        )
        taps.append(lax.slice(x, start, limit, (1, *strides, 1)))
    return taps[0] if len(taps) == 1 else jnp.concatenate(taps, axis=-1)


def _conv_fn(
    lowering: str,
    strides: tuple[int, ...],
    pad: Any,
    dilation: tuple[int, ...],
    dimension_numbers: Any,
    feature_group_count: int,
) -> Callable[..., jax.Array]:
    """`conv(x, w, policy=None)` in the lowering asked for (see `Conv`)."""

    def xla_conv(x, w, policy):
        return precision.conv(
            x,
            w,
            policy,
            window_strides=strides,
            padding=pad,
            rhs_dilation=dilation,
            dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count,
        )

    def onednn_conv(x, w):
        return onednn.conv(x, w, strides, _explicit_pads(pad, x.shape[1:-1], w.shape[:-2], strides, dilation), dilation)

    def conv(x, w, policy=None):
        if lowering == "im2col":
            return conv_im2col(x, w, strides, pad, dilation, policy)
        if lowering == "xla" or feature_group_count != 1:
            return xla_conv(x, w, policy)
        # "auto": im2col where the computation is lowered for the CPU, XLA's convolution on every other platform.
        # On the CPU (measured, docs/performance.md, "im2col convolutions"): as fast as XLA's convolution in a
        # jitted step (2x faster for a 3-channel stem), 20x and more faster inside lax.scan (make_multi_step),
        # where XLA's weight-gradient convolution falls off a cliff; and in half precision its dots keep every
        # backward product bf16 x bf16 -> f32 (precision.einsum), which XLA's convolution transposes cannot.
        # "onednn", and "auto" where oneDNN's convolutions are switched on for the dtype (`onednn.enabled`, read
        # when tracing: by default where they measured faster than this on this CPU), take oneDNN's direct
        # convolutions on the CPU instead (float32 and bfloat16; im2col for other dtypes).
        # The choice follows the platform the computation is lowered for, not this process's default backend, so
        # that a program traced here and exported for a GPU (jax.export) gets the GPU's lowering; both branches
        # are traced, only the lowering platform's is lowered (docs/performance.md, "Lowering per platform").
        use_onednn = lowering == "onednn" or (
            onednn.enabled("conv", x.dtype) and x.shape[-1] >= ONEDNN_AUTO_MIN_CHANNELS
        )
        if use_onednn and onednn.supports(x.dtype, w.dtype):
            cpu = onednn_conv
        else:
            cpu = lambda x, w: conv_im2col(x, w, strides, pad, dilation, policy)  # noqa: E731
        return lax.platform_dependent(x, w, cpu=cpu, default=lambda x, w: xla_conv(x, w, policy))

    return conv


def _kernel_tuple(kernel_size: int | Sequence[int], layer: str) -> tuple[int, ...]:
    kernel = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    if len(kernel) not in _DIMENSION_NUMBERS:
        raise ValueError(f"{layer}: kernel_size must have 1, 2 or 3 entries, got {kernel_size!r}")
    return _as_tuple(kernel, len(kernel), "kernel_size", layer)


def _conv_spatial(in_spatial, pad, kernel, strides, dilation) -> list[int]:
    pads = _explicit_pads(pad, in_spatial, kernel, strides, dilation)
    return [
        (n + lo + hi - (k - 1) * d - 1) // s + 1
        for n, (lo, hi), k, d, s in zip(in_spatial, pads, kernel, dilation, strides)
    ]


def _transpose_pads(mode: str, kernel, strides, dilation) -> list[tuple[int, int]]:
    """The padding of the stride-dilated input that makes a transposed convolution the "SAME" or "VALID" one, as
    `lax.conv_transpose` (and so flax.linen.ConvTranspose) computes it: SAME gives in * stride outputs, VALID
    in * stride + max(kernel - stride, 0), kernel counted with its dilation."""
    pads = []
    for k, s, d in zip(kernel, strides, dilation):
        span = (k - 1) * d + 1
        if mode == "SAME":
            total = span + s - 2
            low = span - 1 if s > span - 1 else -(-total // 2)
        else:
            total = span + s - 2 + max(span - s, 0)
            low = span - 1
        pads.append((low, total - low))
    return pads


def _output_shape(
    name: str,
    in_shape: Shape,
    features: int,
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    out_spatial: Callable[[Shape], list[int]],
    groups: int = 1,
) -> Shape:
    """The output shape for `in_shape`, or the one shape error that init and apply both raise."""
    rank = len(kernel)
    if len(in_shape) != rank + 2:
        raise shape_error(name, f"of rank {rank + 2} ({_DIMENSION_NUMBERS[rank][0]})", in_shape)
    if in_shape[-1] % groups:
        raise shape_error(name, f"with channels divisible by feature_group_count {groups}", in_shape)
    spatial = out_spatial(in_shape[1:-1])
    if min(in_shape[1:-1]) <= 0 or min(spatial) <= 0:
        raise shape_error(name, f"large enough for kernel {kernel} with dilation {dilation}", in_shape)
    return (in_shape[0], *spatial, features)


def _param_shapes(kernel: tuple[int, ...], in_features: int, features: int, use_bias: bool) -> dict[str, Shape]:
    shapes = {"w": (*kernel, in_features, features)}
    if use_bias:
        shapes["b"] = (features,)
    return shapes


def _init_params(key, shapes: dict[str, Shape], w_init, b_init) -> dict[str, jax.Array]:
    params = {"w": w_init(key, shapes["w"], jnp.float32)}
    if "b" in shapes:
        params["b"] = b_init(key, shapes["b"], jnp.float32)
    return params


def _check_apply(name: str, params, x, kwargs, out_shape, param_shapes) -> None:
    """What every convolution's apply refuses: unknown keywords, integer inputs (the weights would be cast to
    integers), an input the layer cannot take, and params made for another input width."""
    check_keywords(name, kwargs)
    check_float_input(name, x)
    shape = tuple(jnp.shape(x))
    out_shape(shape)
    check_params(name, params, param_shapes(shape))


def _add_bias(params, y: jax.Array, use_bias: bool) -> jax.Array:
    return y + along_last_axis(params["b"].astype(y.dtype), y.ndim) if use_bias else y


@describe
def Conv(
    features: int,
    kernel_size: int | Sequence[int],
    *,
    strides: int | Sequence[int] = 1,
    padding: str | int | Sequence[tuple[int, int]] = "SAME",
    dilation: int | Sequence[int] = 1,
    feature_group_count: int = 1,
    use_bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    b_init: initializers.Initializer = initializers.zeros,
    lowering: str = "auto",
    activation: Any = None,
    name: str = "conv",
) -> Layer:
    """Convolution with channels last; the rank (1, 2 or 3) is the length of `kernel_size` (an int means 2-D);
    then `activation` (as in `Dense`: a name, a parameter-free layer or a function).

    `w` has shape kernel_size + (in_channels // feature_group_count, features); products accumulate in float32.
    `lowering`: "xla" is XLA's convolution op; "im2col" computes it as one matmul over the concatenated kernel
    taps (no feature groups); "onednn" runs oneDNN's direct convolutions on the CPU (the optional kernels of
    `jaxnn.kernels.onednn`; float32 and bfloat16, no feature groups; XLA's convolution on accelerators); "auto"
    takes im2col when the computation is lowered for the CPU (no feature groups), where it measures as fast or
    faster and avoids a slow path of XLA's convolution gradients inside `lax.scan`, or oneDNN's kernels where they
    are built and switched on (`jaxnn.kernels.onednn.enabled("conv", dtype)`: by default where they measured faster
    on this CPU, `jaxnn.kernels.onednn.choice`; inputs of at least ONEDNN_AUTO_MIN_CHANNELS
    channels, so an image stem keeps im2col), and XLA's convolution when it is lowered for an accelerator, whose
    convolution kernels are the fast path there.
    The platform is the one jax lowers for (`lax.platform_dependent`), so `jax.export(..., platforms=["cuda"])` on
    a CPU machine gets XLA's convolution.
    """
    check_positive("Conv", features=features, feature_group_count=feature_group_count)
    if lowering not in LOWERINGS:
        raise ValueError(f"Conv: unknown lowering {lowering!r}; choose one of {LOWERINGS}")
    if lowering in ("im2col", "onednn") and feature_group_count != 1:
        raise ValueError(f"Conv: the {lowering} lowering has no feature groups; use lowering='xla'")
    if lowering == "onednn" and not onednn.available():
        raise RuntimeError(f"Conv: lowering='onednn' is not available: {onednn.unavailable_reason()}")
    kernel = _kernel_tuple(kernel_size, "Conv")
    rank = len(kernel)
    strides = _as_tuple(strides, rank, "strides", "Conv")
    dilation = _as_tuple(dilation, rank, "dilation", "Conv")
    pad = _normalise_padding(padding, rank, kernel, dilation, "Conv")
    if features % feature_group_count:
        raise ValueError(f"Conv: features {features} is not divisible by feature_group_count {feature_group_count}")
    conv = _conv_fn(lowering, strides, pad, dilation, _DIMENSION_NUMBERS[rank], feature_group_count)
    act = activation_fn(activation, "Conv")

    def out_shape(in_shape):
        def spatial(n):
            return _conv_spatial(n, pad, kernel, strides, dilation)

        return _output_shape(name, in_shape, features, kernel, dilation, spatial, feature_group_count)

    def param_shapes(in_shape):
        return _param_shapes(kernel, in_shape[-1] // feature_group_count, features, use_bias)

    def init(key, in_shape):
        shape = out_shape(tuple(in_shape))
        return shape, _init_params(key, param_shapes(in_shape), w_init, b_init)

    def apply(params, x, *, policy=None, **kwargs):
        _check_apply(name, params, x, kwargs, out_shape, param_shapes)
        y = _add_bias(params, conv(x, params["w"].astype(x.dtype), policy), use_bias)
        return (y if act is None else act(y)).astype(x.dtype)

    return Layer(init, apply, name)


@describe
def ConvTranspose(
    features: int,
    kernel_size: int | Sequence[int],
    *,
    strides: int | Sequence[int] = 1,
    padding: str | int | Sequence[tuple[int, int]] = "SAME",
    dilation: int | Sequence[int] = 1,
    use_bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    b_init: initializers.Initializer = initializers.zeros,
    name: str = "conv_transpose",
) -> Layer:
    """Transposed ("fractionally strided") convolution with channels last, rank 1, 2 or 3 as in `Conv` (an int
    `kernel_size` means 2-D): the input is spread out `strides` apart, padded, and convolved with `w` at stride 1.

    Outputs and values are those of `flax.linen.ConvTranspose` (and `lax.conv_transpose`) given the same kernel:
    `w` has shape kernel_size + (in_channels, features) and is not flipped (flax's transpose_kernel=False); the
    frameworks that compute the gradient of a convolution instead (PyTorch, Keras) apply their kernel with its
    spatial axes reversed, so reverse them (and reorder the axes to this layout) when importing such weights.
    `padding`: "SAME" gives in * stride outputs per axis; "VALID" in * stride + max(k - stride, 0), where k is the
    kernel size with its dilation; an int or (low, high) pairs pad the spread-out input directly (as flax does),
    giving (in - 1) * stride + 1 + low + high - k + 1. Products accumulate in float32.
    """
    check_positive("ConvTranspose", features=features)
    kernel = _kernel_tuple(kernel_size, "ConvTranspose")
    rank = len(kernel)
    strides = _as_tuple(strides, rank, "strides", "ConvTranspose")
    dilation = _as_tuple(dilation, rank, "dilation", "ConvTranspose")
    if isinstance(padding, str) and padding.upper() not in ("SAME", "VALID"):
        raise ValueError(
            f"ConvTranspose: unknown padding mode {padding!r}; choose 'SAME', 'VALID', an int, or (low, high) pairs"
        )
    pad = _normalise_padding(padding, rank, kernel, dilation, "ConvTranspose")
    pads = _transpose_pads(pad, kernel, strides, dilation) if isinstance(pad, str) else list(pad)
    dimension_numbers = _DIMENSION_NUMBERS[rank]

    def out_shape(in_shape):
        def spatial(n):
            return [
                (m - 1) * s + lo + hi - (k - 1) * d + 1
                for m, s, (lo, hi), k, d in zip(n, strides, pads, kernel, dilation)
            ]

        return _output_shape(name, in_shape, features, kernel, dilation, spatial)

    def param_shapes(in_shape):
        return _param_shapes(kernel, in_shape[-1], features, use_bias)

    def init(key, in_shape):
        shape = out_shape(tuple(in_shape))
        return shape, _init_params(key, param_shapes(in_shape), w_init, b_init)

    def apply(params, x, *, policy=None, **kwargs):
        _check_apply(name, params, x, kwargs, out_shape, param_shapes)
        y = precision.conv(
            x,
            params["w"].astype(x.dtype),
            policy,
            window_strides=(1,) * rank,
            padding=pads,
            lhs_dilation=strides,
            rhs_dilation=dilation,
            dimension_numbers=dimension_numbers,
        )
        return _add_bias(params, y, use_bias).astype(x.dtype)

    return Layer(init, apply, name)
