"""ImageNet ResNets (He et al. 2016) with torchvision's exact layout, so that its checkpoints load unchanged
(`jaxnn.interop.torchvision`): ResNet-18/34 of basic blocks, ResNet-50 of bottleneck blocks, channels last.

torchvision's variant is "v1.5": a bottleneck block strides in its 3x3 convolution, not its first 1x1. Every
convolution pads k // 2 on both sides, as torch does; "SAME" would pad a stride-2 convolution of an even input
by (0, 1) instead of (1, 1) and compute other windows than the checkpoint was trained with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.nn import initializers

from jaxnn.layers import BatchNorm, Conv, Dense, GlobalAvgPool, Layer, MaxPool, Relu, run, serial
from jaxnn.layers.core import as_child, check_keywords, describe, shape_error, with_name

BLOCKS = ("basic", "bottleneck")
EXPANSION = {"basic": 1, "bottleneck": 4}  # a block's output width over its stage's width
# torchvision initialises convolutions with He's normal over the fan out; its BatchNorms with scale 1, bias 0.
CONV_INIT = initializers.variance_scaling(2.0, "fan_out", "normal")


@dataclasses.dataclass(frozen=True)
class ImageNetResNetConfig:
    """An ImageNet ResNet: `stage_sizes` blocks per stage at widths width * 2^i, stride 2 from the second stage.

    The default is ResNet-18; ResNet-34 is stage_sizes=(3, 4, 6, 3), ResNet-50 that with block="bottleneck"
    (see `PRESETS`). Inputs are (N, H, W, 3) images; torchvision's weights expect 224x224 normalised by ImageNet's
    mean and standard deviation."""

    stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
    block: str = "basic"
    width: int = 64
    num_classes: int = 1000
    # Inside shard_map/pmap, the device axis BatchNorm averages its statistics over (None: per device).
    bn_axis_name: str | None = None

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise ValueError(f"ImageNetResNetConfig: unknown block {self.block!r}; choose one of {BLOCKS}")
        if not self.stage_sizes or any(not isinstance(n, int) or n <= 0 for n in self.stage_sizes):
            raise ValueError(f"ImageNetResNetConfig: stage_sizes must be positive ints, got {self.stage_sizes!r}")

    def small(self) -> ImageNetResNetConfig:
        """One block per stage, width 8, 10 classes: the same architecture for tests and smoke runs."""
        return dataclasses.replace(self, stage_sizes=(1,) * len(self.stage_sizes), width=8, num_classes=10)


def _conv(features: int, kernel: int, strides: int, name: str) -> Layer:
    # torch's padding=k // 2 on both sides of every axis, and no bias: a BatchNorm follows every convolution.
    return Conv(features, kernel, strides=strides, padding=kernel // 2, use_bias=False, w_init=CONV_INIT, name=name)


def _body(block: str, width: int, strides: int, bn: Callable[[str], Layer]) -> Layer:
    """A block's residual branch, its layers named as torchvision's (conv1, bn1, ...)."""
    if block == "basic":
        return serial(
            _conv(width, 3, strides, "conv1"), bn("bn1"), Relu, _conv(width, 3, 1, "conv2"), bn("bn2"), name="body"
        )
    return serial(
        *(_conv(width, 1, 1, "conv1"), bn("bn1"), Relu),
        *(_conv(width, 3, strides, "conv2"), bn("bn2"), Relu),
        *(_conv(width * EXPANSION[block], 1, 1, "conv3"), bn("bn3")),
        name="body",
    )


@describe
def residual_block(body: Layer, shortcut: Layer | None, name: str = "block") -> Layer:
    """relu(body(x) + shortcut(x)), the shortcut the identity when None. Params and state are `{"0_body": ...}`
    and, with a shortcut, `"1_shortcut"`; the block is stateful, its state that of its stateful branches (here
    both: they hold BatchNorms).

    Why not `residual`: that needs the branch to keep the input's shape, and a projection block changes it."""
    branches = [("0_body", body)] + ([("1_shortcut", shortcut)] if shortcut is not None else [])

    def init(key, in_shape):
        params, shapes = {}, []
        for i, (child_key, layer) in enumerate(branches):
            with as_child(child_key, layer):
                out_shape, params[child_key] = layer.init(jax.random.fold_in(key, i), in_shape)
            shapes.append(tuple(out_shape))
        if shapes[-1] != shapes[0] or (shortcut is None and shapes[0] != tuple(in_shape)):
            raise shape_error(name, f"that both branches map to one shape (they give {shapes})", in_shape)
        return shapes[0], params

    def init_state(in_shape):
        return {child_key: layer.init_state(in_shape) for child_key, layer in branches if layer.init_state}

    def apply(params, x, *, state=None, key=None, train=False, policy=None, **kwargs):
        check_keywords(name, kwargs)
        outs, new_state, state = [], {}, state or {}
        for i, (child_key, layer) in enumerate(branches):
            child_rng = None if key is None else jax.random.fold_in(key, i)
            with as_child(child_key, layer):
                y, child_state = run(
                    layer,
                    params.get(child_key, {}),
                    x,
                    state=state.get(child_key),
                    key=child_rng,
                    train=train,
                    policy=policy,
                )
            if layer.stateful:
                new_state[child_key] = child_state
            outs.append(y)
        shortcut_out = outs[1] if shortcut is not None else x
        return jax.nn.relu(outs[0] + shortcut_out.astype(outs[0].dtype)), new_state

    return Layer(with_name(name, init), with_name(name, apply), name, init_state)


def has_projection(cfg: ImageNetResNetConfig, stage: int, block: int) -> bool:
    """Whether block `block` of stage `stage` has a 1x1 projection shortcut (torchvision's downsample): the first
    block of every stage after the first (it strides), and of the first too when its blocks widen (bottleneck)."""
    return block == 0 and (stage > 0 or EXPANSION[cfg.block] != 1)


def _stage(cfg: ImageNetResNetConfig, index: int, bn: Callable[[str], Layer]) -> Layer:
    """Stage `index` (torchvision's layer{index + 1})."""
    width = cfg.width * 2**index
    out_width = width * EXPANSION[cfg.block]
    blocks = []
    for j in range(cfg.stage_sizes[index]):
        strides = 2 if index > 0 and j == 0 else 1
        shortcut = None
        if has_projection(cfg, index, j):
            shortcut = serial(_conv(out_width, 1, strides, "conv"), bn("bn"), name="downsample")
        blocks.append(residual_block(_body(cfg.block, width, strides, bn), shortcut, name="block"))
    return serial(*blocks, name=f"layer{index + 1}")


@describe
def ImageNetResNet(cfg: ImageNetResNetConfig = ImageNetResNetConfig()) -> Layer:
    """7x7/2 stem convolution, BatchNorm, ReLU, 3x3/2 max pooling (padded 1), the stages, global average pooling
    and a Dense classifier; (N, H, W, 3) -> (N, num_classes) logits. Params and state are keyed like torchvision's
    names: "0_conv1", "1_bn1", "4_layer1" ... , "9_fc" for four stages (see `jaxnn.interop.torchvision`)."""

    def bn(name: str) -> Layer:
        # momentum 0.9 here is torch's momentum=0.1 (the weight of the old running value; see BatchNorm).
        return BatchNorm(momentum=0.9, eps=1e-5, axis_name=cfg.bn_axis_name, name=name)

    stem = [
        Conv(cfg.width, 7, strides=2, padding=3, use_bias=False, w_init=CONV_INIT, name="conv1"),
        bn("bn1"),
        Relu,
        MaxPool(3, 2, ((1, 1), (1, 1)), name="maxpool"),
    ]
    stages = [_stage(cfg, index, bn) for index in range(len(cfg.stage_sizes))]
    return serial(*stem, *stages, GlobalAvgPool(name="avgpool"), Dense(cfg.num_classes, name="fc"), name="resnet")


# name -> (config, published trainable parameter count (torchvision's model card), description).
PRESETS: dict[str, tuple[ImageNetResNetConfig, int, str]] = {
    "resnet18": (ImageNetResNetConfig(), 11_689_512, "ResNet-18 (torchvision resnet18), ImageNet 224x224"),
    "resnet34": (
        ImageNetResNetConfig(stage_sizes=(3, 4, 6, 3)),
        21_797_672,
        "ResNet-34 (torchvision resnet34), ImageNet 224x224",
    ),
    "resnet50": (
        ImageNetResNetConfig(stage_sizes=(3, 4, 6, 3), block="bottleneck"),
        25_557_032,
        "ResNet-50 v1.5 (torchvision resnet50), ImageNet 224x224",
    ),
}

__all__ = [
    "BLOCKS",
    "EXPANSION",
    "ImageNetResNet",
    "ImageNetResNetConfig",
    "PRESETS",
    "has_projection",
    "residual_block",
]
