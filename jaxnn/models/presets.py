"""Named presets: the shapes of published models (GPT-2, Llama-style decoders, ResNets, ViTs) as configs of
jaxnn's model families, each with the parameter count its authors published.

    family, cfg = preset("gpt2")             # ("gpt", GPTConfig(vocab_size=50257, ...))
    model = jaxnn.models.get_model(family, cfg)

A preset is a config like any other: `jaxnn train --model gpt2 --model-config '{"num_layers": 2}'` starts from it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxnn.models import gpt, imagenet_resnet, vit


class Preset(NamedTuple):
    """A published model's shape: the jaxnn family that builds it, its config, and the published count of
    trainable parameters (None where the authors published none)."""

    family: str
    config: Any
    published_params: int | None
    description: str


# Each family module lists its presets (name -> Preset); one table here, so a name means one model everywhere.
PRESETS: dict[str, Preset] = {
    name: Preset(family, cfg, count, text)
    for family, module in (("gpt", gpt), ("imagenet_resnet", imagenet_resnet), ("vit", vit))
    for name, (cfg, count, text) in module.PRESETS.items()
}


def preset(name: str) -> tuple[str, Any]:
    """The family and config of preset `name`; a KeyError naming the presets there are."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].family, PRESETS[name].config


__all__ = ["PRESETS", "Preset", "preset"]
