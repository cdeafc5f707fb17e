"""Models built only from jaxnn.layers, each with a frozen config that has a `small()` variant for quick runs."""

from jaxnn.models.cnn import CNN, CNNConfig, ResNet, ResNetConfig
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.models.mlp import MLP, MLPConfig

CONFIGS = {"mlp": MLPConfig, "cnn": CNNConfig, "resnet": ResNetConfig, "gpt": GPTConfig}
BUILDERS = {"mlp": MLP, "cnn": CNN, "resnet": ResNet, "gpt": GPT}


def get_model(name: str, cfg=None):
    """The model layer for `name` ('mlp', 'cnn', 'resnet', 'gpt'), from `cfg` or the default config."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(BUILDERS)}")
    return BUILDERS[name](cfg if cfg is not None else CONFIGS[name]())


__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "MLP",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "get_model",
    "CONFIGS",
    "BUILDERS",
]
