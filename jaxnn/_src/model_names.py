"""The built-in model families' names and sizes, as plain text: `jaxnn train` and `jaxnn profile` name them in
their flags' help while parsing, before jax may load, and `jaxnn.models` (which loads jax) builds from them.

`jaxnn.models.factory` is their public home and re-exports both.
"""

MODELS = ("mlp", "cnn", "resnet", "gpt", "imagenet_resnet", "vit")
SIZES = ("small", "base")
