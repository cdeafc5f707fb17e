"""LSTM and GRU cells, RNN and Bidirectional: parity with Flax Linen given the same weights, a float64 numpy
reference, padding masks, and clear errors for bad input.

Shapes repeat across tests (B=2, T=5, F=3, features=4) so that the scans compiled for one test serve the next."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L

B, T, F, H = 2, 5, 3, 4
TOL = {"rtol": 1e-5, "atol": 1e-5}
LENGTHS = np.array([5, 3])  # the second row ends in two padded steps
MASK = jnp.asarray(np.arange(T)[None, :] < LENGTHS[:, None])


def make_cell(kind):
    return L.LSTMCell(H) if kind == "lstm" else L.GRUCell(H)


def random_params(cell, seed=0):
    """Random values for every weight and bias (not the initialisers' zeros), drawn by numpy: random draws by jax
    would compile one sampler per parameter shape, which is most of these tests' time on a small CPU."""
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32) for name, shape in cell.param_shapes(F).items()
    }


def to_flax(kind, params):
    """Our fused per-gate blocks as Flax's one Dense per gate."""
    if kind == "lstm":
        w_x, w_h, b = (np.split(np.asarray(params[n]), 4, axis=-1) for n in ("w_x", "w_h", "b"))
        flax_params = {f"i{g}": {"kernel": w_x[i]} for i, g in enumerate("ifgo")}
        flax_params |= {f"h{g}": {"kernel": w_h[i], "bias": b[i]} for i, g in enumerate("ifgo")}
        return flax_params
    w_x, b_x, w_h = (np.split(np.asarray(params[n]), 3, axis=-1) for n in ("w_x", "b_x", "w_h"))
    flax_params = {f"i{g}": {"kernel": w_x[i], "bias": b_x[i]} for i, g in enumerate("rzn")}
    flax_params |= {f"h{g}": {"kernel": w_h[i]} for i, g in enumerate("rz")}
    flax_params["hn"] = {"kernel": w_h[2], "bias": np.asarray(params["b_hn"])}
    return flax_params


def flax_cell(kind):
    return nn.LSTMCell(H) if kind == "lstm" else nn.GRUCell(H)


def inputs(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, F)), jnp.float32)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_matches_flax_step_by_step(kind):
    cell = make_cell(kind)
    params = random_params(cell)
    variables = {"params": to_flax(kind, params)}
    x = inputs()
    carry = cell.initial_carry((B,), jnp.float32)
    flax_carry = carry  # zeros, as flax's initialize_carry makes
    step = jax.jit(cell.step)
    flax_step = jax.jit(flax_cell(kind).apply)
    for t in range(3):
        carry, y = step(params, carry, x[:, t])
        flax_carry, flax_y = flax_step(variables, flax_carry, x[:, t])
        np.testing.assert_allclose(y, flax_y, **TOL, err_msg=f"step {t}")
        for ours, theirs in zip(jax.tree.leaves(carry), jax.tree.leaves(flax_carry)):
            np.testing.assert_allclose(ours, theirs, **TOL, err_msg=f"step {t}")


@pytest.mark.parametrize("kind, reverse", [("lstm", False), ("lstm", True), ("gru", False), ("gru", True)])
def test_rnn_matches_flax_rnn_with_seq_lengths(kind, reverse):
    cell = make_cell(kind)
    params = random_params(cell)
    x = inputs()
    carry, y = L.RNN(cell, reverse=reverse, return_carry=True).apply(params, x, mask=MASK)
    flax_rnn = nn.RNN(flax_cell(kind), reverse=reverse, keep_order=True, return_carry=True)
    flax_carry, flax_y = flax_rnn.apply(
        {"params": {"cell": to_flax(kind, params)}}, x, seq_lengths=jnp.asarray(LENGTHS)
    )
    real = np.asarray(MASK)
    np.testing.assert_allclose(np.asarray(y)[real], np.asarray(flax_y)[real], **TOL)  # Flax leaves padding as is
    np.testing.assert_array_equal(np.asarray(y)[~real], 0.0)
    for ours, theirs in zip(jax.tree.leaves(carry), jax.tree.leaves(flax_carry)):
        np.testing.assert_allclose(ours, theirs, **TOL)


def test_lstm_step_matches_a_float64_numpy_reference():
    def sigmoid(v):
        return 1 / (1 + np.exp(-v))

    cell = L.LSTMCell(H)
    rng = np.random.default_rng(3)
    params = {name: rng.normal(size=shape) * 0.5 for name, shape in cell.param_shapes(F).items()}
    x, c, h = rng.normal(size=(B, F)), rng.normal(size=(B, H)), rng.normal(size=(B, H))
    with jax.enable_x64(True):
        (new_c, new_h), y = jax.jit(cell.step)(params, (c, h), jnp.asarray(x))
        assert y.dtype == new_c.dtype == jnp.float64

    w_x, w_h, b = (np.asarray(params[n], np.float64) for n in ("w_x", "w_h", "b"))
    gate = {g: x @ w_x[:, i * H : (i + 1) * H] + h @ w_h[:, i * H : (i + 1) * H] + b[i * H : (i + 1) * H]
            for i, g in enumerate("ifgo")}  # fmt: skip
    expected_c = sigmoid(gate["f"]) * c + sigmoid(gate["i"]) * np.tanh(gate["g"])
    expected_h = sigmoid(gate["o"]) * np.tanh(expected_c)
    np.testing.assert_allclose(new_c, expected_c, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new_h, expected_h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, expected_h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_padded_steps_leave_the_carry_unchanged(reverse):
    layer = L.RNN(L.LSTMCell(H), reverse=reverse, return_carry=True)
    params = random_params(L.LSTMCell(H))
    x = inputs()
    carry, y = layer.apply(params, x, mask=MASK)
    noise = inputs(seed=5)[0, :2] * 10
    carry2, y2 = layer.apply(params, x.at[1, 3:].set(noise), mask=MASK)
    np.testing.assert_array_equal(y2, y)
    for a, b in zip(jax.tree.leaves(carry2), jax.tree.leaves(carry)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(y[1, 3:], 0.0)

    # The padded row is the unpadded row of three steps, run alone (backwards from its last real step if reversed).
    alone_carry, alone_y = layer.apply(params, x[1:, :3])
    np.testing.assert_allclose(y[1:, :3], alone_y, **TOL)
    for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(alone_carry)):
        np.testing.assert_allclose(a[1:], b, **TOL)


def test_mask_reaches_an_rnn_inside_serial():
    model = L.serial(L.Dense(F), L.RNN(L.LSTMCell(H)))
    dense = {"w": jnp.eye(F) + 0.1, "b": jnp.full((F,), 0.2)}
    params = {"0_dense": dense, "1_rnn": random_params(L.LSTMCell(H))}
    x = inputs()
    y = model.apply(params, x, mask=MASK)
    hidden = L.Dense(F).apply(params["0_dense"], x)
    np.testing.assert_allclose(y, L.RNN(L.LSTMCell(H)).apply(params["1_rnn"], hidden, mask=MASK), **TOL)
    np.testing.assert_array_equal(y[1, 3:], 0.0)
    assert np.all(np.asarray(model.apply(params, x)[1, 3:]) != 0.0)


def test_bidirectional_concatenates_both_directions_and_their_carries(key):
    forward, backward = L.RNN(L.GRUCell(H), return_carry=True), L.RNN(L.LSTMCell(H), reverse=True, return_carry=True)
    layer = L.Bidirectional(forward, backward)
    out_shape = L.output_shape(layer, (B, T, F))
    params = {"forward": random_params(L.GRUCell(H)), "backward": random_params(L.LSTMCell(H))}
    assert out_shape == (((B, H), ((B, H), (B, H))), (B, T, 2 * H))
    (carry_f, carry_b), y = layer.apply(params, inputs(), mask=MASK)
    expected_f = forward.apply(params["forward"], inputs(), mask=MASK)
    expected_b = backward.apply(params["backward"], inputs(), mask=MASK)
    np.testing.assert_allclose(y, jnp.concatenate([expected_f[1], expected_b[1]], axis=-1), **TOL)
    np.testing.assert_allclose(carry_f, expected_f[0], **TOL)
    for a, b in zip(jax.tree.leaves(carry_b), jax.tree.leaves(expected_b[0])):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda layer, p, x: layer.apply(p, x.astype(jnp.int32)),
            TypeError,
            r"^rnn: expected a floating-point input, got dtype int32",
        ),
        (
            lambda layer, p, x: layer.apply(p, x, mask=MASK[:, :4]),
            ValueError,
            r"^rnn: expected a \(batch, time\) mask of shape \(2, 5\) for input of shape \(2, 5, 3\), "
            r"got mask of shape \(2, 4\)$",
        ),
        (
            lambda layer, p, x: layer.apply(p, x, mask=MASK.astype(jnp.float32)),
            TypeError,
            r"^rnn: expected a bool mask \(True for real steps\), got dtype float32",
        ),
        (
            lambda layer, p, x: layer.apply(p, x, trian=True),
            TypeError,
            r"^rnn: apply got unexpected keyword\(s\) trian; it takes key, mask, policy, state, train$",
        ),
        (
            lambda layer, p, x: layer.apply(random_params(L.LSTMCell(8)), x),
            ValueError,
            r"^rnn: parameter 'w_x' has shape \(3, 32\), this layer needs \(3, 16\)$",
        ),
        (lambda layer, p, x: layer.apply(p, x[0]), ValueError, r"^rnn: expected input of rank 3 .*got shape \(5, 3\)"),
        (lambda layer, p, x: layer.init(jax.random.key(1), (2, 3)), ValueError, r"^rnn: expected input of rank 3"),
        (
            lambda layer, p, x: L.Bidirectional(layer, L.RNN(L.GRUCell(H), reverse=True)).apply(
                {"forward": p, "backward": {}}, x, mask=MASK[:1]
            ),
            ValueError,
            r"^bidirectional/forward: expected a \(batch, time\) mask .*got mask of shape \(1, 5\)$",
        ),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(call, error, message):
    layer = L.RNN(L.LSTMCell(H))
    with pytest.raises(error, match=message):
        call(layer, random_params(L.LSTMCell(H)), inputs())


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: L.LSTMCell(0), r"LSTMCell: features must be a positive integer, got 0"),
        (lambda: L.GRUCell(-1), r"GRUCell: features must be a positive integer, got -1"),
        (
            lambda: L.Bidirectional(L.RNN(L.LSTMCell(H)), L.RNN(L.LSTMCell(H))),
            r"Bidirectional: backward_rnn runs forward; build it with RNN\(cell, reverse=True\)",
        ),
        (
            lambda: L.Bidirectional(L.RNN(L.LSTMCell(H), reverse=True), L.RNN(L.LSTMCell(H), reverse=True)),
            r"Bidirectional: forward_rnn runs backward; build it with RNN\(cell, reverse=False\)",
        ),
    ],
)
def test_bad_construction_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
