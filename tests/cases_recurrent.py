"""Conformance cases for tests/test_layers.py: name -> (layer factory, input shape, input kind)."""

from jaxnn import layers as L

# The bidirectional case reuses the other cases' cells and shapes, so the scans compiled for one serve the others;
# its backward direction is the reverse scan.
CASES: dict = {
    "lstm": (lambda: L.RNN(L.LSTMCell(4)), (2, 5, 3), "float"),
    "gru": (lambda: L.RNN(L.GRUCell(4)), (2, 5, 3), "float"),
    "bidirectional": (
        lambda: L.Bidirectional(L.RNN(L.GRUCell(4)), L.RNN(L.LSTMCell(4), reverse=True)),
        (2, 5, 3),
        "float",
    ),
}
# name -> number of bf16 roundings the layer's output may carry (see test_layers.BF16_ROUNDINGS)
# The carry stays float32, but h is rounded to bf16 for each step's recurrent product, and the output is rounded:
# two roundings. Measured at keys 0-4: within 0.8 U of the scale for every case.
BF16_ROUNDINGS: dict = {"lstm": 2, "gru": 2, "bidirectional": 2}
