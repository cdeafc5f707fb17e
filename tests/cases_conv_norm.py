"""Conformance cases for tests/test_layers.py: name -> (layer factory, input shape, input kind)."""

from jaxnn import layers as L

# 1-D transposed convolutions share the N-D code; tests/test_conv_norm.py checks them against Flax.
CASES: dict = {
    "conv3d": (lambda: L.Conv(3, (2, 2, 2), strides=(1, 2, 1)), (2, 3, 5, 3, 2), "float"),
    "conv_transpose2d": (lambda: L.ConvTranspose(3, (3, 2), strides=2, padding="VALID"), (2, 3, 3, 2), "float"),
    "conv_transpose3d": (
        lambda: L.ConvTranspose(2, (2, 2, 2), strides=(2, 1, 2), padding=((1, 0), (0, 1), (1, 1))),
        (1, 2, 3, 2, 2),
        "float",
    ),
    "group_norm": (lambda: L.GroupNorm(2), (2, 3, 3, 4), "float"),
    "instance_norm": (lambda: L.InstanceNorm(), (2, 4, 3, 3), "float"),
}
# name -> number of bf16 roundings the layer's output may carry (see test_layers.BF16_ROUNDINGS)
BF16_ROUNDINGS: dict = {}
