"""Convolutional image classifiers for small (8x8 digits up to 32x32) channels-last images."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxnn.layers import BatchNorm, Conv, Dense, Flatten, GlobalAvgPool, Layer, MaxPool, Relu, residual, serial
from jaxnn.layers.core import describe


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """A small VGG-style CNN: per width a 3x3 convolution, ReLU and 2x2 max pooling, then a linear classifier."""

    widths: tuple[int, ...] = (32, 64, 128)
    num_classes: int = 10

    def small(self) -> CNNConfig:
        """Two narrow stages (8, 16): the same model for tests and smoke runs."""
        return dataclasses.replace(self, widths=(8, 16))


@describe
def CNN(cfg: CNNConfig = CNNConfig()) -> Layer:
    """Per width: a 3x3 convolution, ReLU and 2x2 max pooling; then a Dense classifier on the flattened map."""
    stages = [
        layer for width in cfg.widths for layer in (Conv(width, 3, padding="SAME"), Relu, MaxPool(2, padding="SAME"))
    ]
    return serial(*stages, Flatten(), Dense(cfg.num_classes, name="logits"), name="cnn")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """A CIFAR-style ResNet: `blocks_per_stage` basic blocks at each width, stride 2 between stages."""

    widths: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 2
    num_classes: int = 10
    # Inside shard_map/pmap, the device axis BatchNorm averages its statistics over (None: per device).
    bn_axis_name: str | None = None

    def small(self) -> ResNetConfig:
        """Two narrow stages (8, 16) of one block each: the same model for tests and smoke runs."""
        return dataclasses.replace(self, widths=(8, 16), blocks_per_stage=1)


def _basic_block(width: int, bn: Callable[[], Layer]) -> Layer:
    return serial(residual(Conv(width, 3), bn(), Relu, Conv(width, 3), bn(), name="block"), Relu, name="basic")


@describe
def ResNet(cfg: ResNetConfig = ResNetConfig()) -> Layer:
    """Stem conv, stages of residual basic blocks (a strided conv changes width between stages), global pooling."""

    def bn() -> Layer:
        return BatchNorm(axis_name=cfg.bn_axis_name)

    layers = [Conv(cfg.widths[0], 3, name="stem"), bn(), Relu]
    for i, width in enumerate(cfg.widths):
        if i > 0:
            layers += [Conv(width, 3, strides=2, name="down"), bn(), Relu]
        layers += [_basic_block(width, bn) for _ in range(cfg.blocks_per_stage)]
    return serial(*layers, GlobalAvgPool(), Dense(cfg.num_classes, name="logits"), name="resnet")
