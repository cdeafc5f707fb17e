"""Multi-layer perceptron."""

from __future__ import annotations

import dataclasses

from jaxnn.layers import Dense, Flatten, Layer, Relu, serial
from jaxnn.layers.core import describe


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """A multilayer perceptron on the flattened input: one Dense + ReLU per `hidden` width, then the classifier."""

    hidden: tuple[int, ...] = (512, 512)
    num_classes: int = 10

    def small(self) -> MLPConfig:
        """One hidden layer of 64: the same model for tests and smoke runs."""
        return dataclasses.replace(self, hidden=(64,))


@describe
def MLP(cfg: MLPConfig = MLPConfig()) -> Layer:
    """Flatten, then Dense + ReLU per hidden width, then a Dense classifier producing logits."""
    hidden = [layer for width in cfg.hidden for layer in (Dense(width), Relu)]
    return serial(Flatten(), *hidden, Dense(cfg.num_classes, name="logits"), name="mlp")
