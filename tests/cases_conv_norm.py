"""Conformance cases for tests/test_layers.py: name -> (layer factory, input shape, input kind)."""

CASES: dict = {}
# name -> number of bf16 roundings the layer's output may carry (see test_layers.BF16_ROUNDINGS)
BF16_ROUNDINGS: dict = {}
