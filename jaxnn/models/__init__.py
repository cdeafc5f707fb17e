"""Models built only from jaxnn.layers, each with a frozen config that has a `small()` variant for quick runs."""

from collections.abc import Callable
from typing import Any, TypeAlias

from jaxnn.layers import Layer
from jaxnn.models.cnn import CNN, CNNConfig, ResNet, ResNetConfig
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.models.imagenet_resnet import ImageNetResNet, ImageNetResNetConfig
from jaxnn.models.mlp import MLP, MLPConfig
from jaxnn.models.vit import ViT, ViTConfig

ModelConfig: TypeAlias = MLPConfig | CNNConfig | ResNetConfig | GPTConfig | ImageNetResNetConfig | ViTConfig

# Per name, the config class and the builder that takes it. The value types depend on the key, which a dict's type
# cannot say; Any (not ModelConfig) lets callers use a config as its own class, e.g. in dataclasses.replace.
CONFIGS: dict[str, Callable[[], Any]] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    "resnet": ResNetConfig,
    "gpt": GPTConfig,
    "imagenet_resnet": ImageNetResNetConfig,
    "vit": ViTConfig,
}
BUILDERS: dict[str, Callable[[Any], Layer]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet": ResNet,
    "gpt": GPT,
    "imagenet_resnet": ImageNetResNet,
    "vit": ViT,
}


def get_model(name: str, cfg: ModelConfig | None = None) -> Layer:
    """The model layer for `name` ('mlp', 'cnn', 'resnet', 'gpt', 'imagenet_resnet', 'vit'), from `cfg` or the
    default config."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(BUILDERS)}")
    return BUILDERS[name](cfg if cfg is not None else CONFIGS[name]())


__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "ImageNetResNet",
    "ImageNetResNetConfig",
    "MLP",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "ViT",
    "ViTConfig",
    "get_model",
    "CONFIGS",
    "BUILDERS",
]
