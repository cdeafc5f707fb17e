"""Recurrent layers: LSTM and GRU cells, `RNN` (a cell scanned over time) and `Bidirectional`.

A cell is a small object of pure functions, `init(key, in_features) -> params`, `initial_carry(batch_shape,
dtype)` and `step(params, carry, x_t, policy) -> (carry, y_t)`, with the gate equations of flax.linen's
LSTMCell and GRUCell: given the same weights (split per gate) the two compute the same numbers. Products
accumulate in float32 (or wider), the gates and the carry are float32 too, and `y_t` comes back in the input's
dtype; the carry never rounds to bf16 between steps, so a long sequence does not accumulate bf16 rounding in it.

`RNN(cell)` maps (B, T, F) inputs to (B, T, features). Its side input `mask` ((B, T) bool, True for real steps,
padding at the end of each row) freezes the carry on padded steps and zeroes their outputs, so the final carry is
the one at each row's last real step; with `reverse=True` the scan runs from the end, and because padded steps
leave the initial carry untouched each row is read backwards over its real steps only (as flax.linen.RNN with
`seq_lengths` does).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Protocol, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers
from jax.typing import DTypeLike

from jaxnn import precision
from jaxnn.layers.core import (
    ApplyFn,
    Layer,
    LayerError,
    LayerTypeError,
    Params,
    PRNGKey,
    Shape,
    along_last_axis,
    as_child,
    check_float_input,
    check_keywords,
    check_params,
    check_positive,
    describe,
    shape_error,
    with_name,
)
from jaxnn.precision import Policy, accumulation_dtype

Carry: TypeAlias = Any  # a pytree of (*batch, features) arrays: (c, h) for the LSTM, h for the GRU

_SIDE_INPUTS = frozenset({"mask"})


class Cell(Protocol):
    """What `RNN` scans: one time step of a recurrent network as pure functions."""

    features: int

    def init(self, key: PRNGKey, in_features: int) -> Params:
        """Parameters for inputs with `in_features` features."""
        ...

    def param_shapes(self, in_features: int) -> dict[str, Shape]:
        """The shape of each parameter `init` makes for `in_features`."""
        ...

    def initial_carry(self, batch_shape: Shape, dtype: DTypeLike) -> Carry:
        """The carry before the first step (zeros)."""
        ...

    def step(self, params: Params, carry: Carry, x_t: jax.Array, policy: Policy | None = None) -> tuple[Carry, Any]:
        """One step: `(new_carry, y_t)` from the carry and the (*batch, in_features) input at one time."""
        ...


def _per_gate(init: initializers.Initializer, key: PRNGKey, shape: Shape, gates: int) -> jax.Array:
    # One draw per gate, concatenated: orthogonal recurrent kernels are orthogonal gate by gate, as in Flax,
    # rather than one (H, gates * H) matrix with orthonormal rows.
    keys = jax.random.split(key, gates)
    return jnp.concatenate([init(k, shape, jnp.float32) for k in keys], axis=-1)


def _bias(b: jax.Array, like: jax.Array) -> jax.Array:
    return along_last_axis(b.astype(like.dtype), like.ndim)


@dataclasses.dataclass(frozen=True)
class LSTMCell:
    """flax.linen.LSTMCell's equations, gates in the order i, f, g, o:

        i, f, o = sigmoid(x W_x + h W_h + b) (their blocks), g = tanh(...), c' = f c + i g, h' = o tanh(c').

    Params: `w_x` (in, 4 * features), `w_h` (features, 4 * features), `b` (4 * features); Flax's per-gate
    kernels `ii`, `if`, `ig`, `io` are the column blocks of `w_x`, `hi` ... `ho` those of `w_h` and their biases
    those of `b`. The carry is `(c, h)`, as in Flax.
    """

    features: int
    kernel_init: initializers.Initializer = dataclasses.field(default=initializers.lecun_normal(), kw_only=True)
    recurrent_init: initializers.Initializer = dataclasses.field(default=initializers.orthogonal(), kw_only=True)
    bias_init: initializers.Initializer = dataclasses.field(default=initializers.zeros, kw_only=True)

    def __post_init__(self) -> None:
        check_positive("LSTMCell", features=self.features)

    def param_shapes(self, in_features: int) -> dict[str, Shape]:
        """The shape of each parameter for inputs with `in_features` features."""
        h = self.features
        return {"w_x": (in_features, 4 * h), "w_h": (h, 4 * h), "b": (4 * h,)}

    def init(self, key: PRNGKey, in_features: int) -> Params:
        """Parameters for inputs with `in_features` features, each gate's block drawn on its own."""
        k_x, k_h, k_b = jax.random.split(key, 3)
        h = self.features
        return {
            "w_x": _per_gate(self.kernel_init, k_x, (in_features, h), 4),
            "w_h": _per_gate(self.recurrent_init, k_h, (h, h), 4),
            "b": _per_gate(self.bias_init, k_b, (h,), 4),
        }

    def initial_carry(self, batch_shape: Shape, dtype: DTypeLike = jnp.float32) -> Carry:
        """`(c, h)`, both zeros of shape (*batch_shape, features)."""
        zeros = jnp.zeros((*batch_shape, self.features), dtype)
        return zeros, zeros

    def step(self, params: Params, carry: Carry, x_t: jax.Array, policy: Policy | None = None) -> tuple[Carry, Any]:
        """One step: `((c', h'), h')`, the carry in its own dtype and the output in `x_t`'s."""
        c, h = carry
        z = precision.dense(x_t, params["w_x"], policy) + precision.dense(h.astype(x_t.dtype), params["w_h"], policy)
        z = z + _bias(params["b"], z)
        i, f, g, o = jnp.split(z, 4, axis=-1)
        new_c = jax.nn.sigmoid(f) * c.astype(z.dtype) + jax.nn.sigmoid(i) * jnp.tanh(g)
        new_h = jax.nn.sigmoid(o) * jnp.tanh(new_c)
        return (new_c.astype(c.dtype), new_h.astype(h.dtype)), new_h.astype(x_t.dtype)


@dataclasses.dataclass(frozen=True)
class GRUCell:
    """flax.linen.GRUCell's equations, gates in the order r, z, n, the reset gate applied after the recurrent
    product (and its bias):

        r = sigmoid(x W_xr + b_xr + h W_hr), z = sigmoid(x W_xz + b_xz + h W_hz),
        n = tanh(x W_xn + b_xn + r (h W_hn + b_hn)), h' = (1 - z) n + z h.

    Params: `w_x` (in, 3 * features), `b_x` (3 * features), `w_h` (features, 3 * features), `b_hn` (features);
    Flax's `ir`, `iz`, `in` are the column blocks of `w_x`/`b_x`, `hr`, `hz`, `hn` those of `w_h`, and `b_hn` is
    `hn`'s bias. The carry is `h`.
    """

    features: int
    kernel_init: initializers.Initializer = dataclasses.field(default=initializers.lecun_normal(), kw_only=True)
    recurrent_init: initializers.Initializer = dataclasses.field(default=initializers.orthogonal(), kw_only=True)
    bias_init: initializers.Initializer = dataclasses.field(default=initializers.zeros, kw_only=True)

    def __post_init__(self) -> None:
        check_positive("GRUCell", features=self.features)

    def param_shapes(self, in_features: int) -> dict[str, Shape]:
        """The shape of each parameter for inputs with `in_features` features."""
        h = self.features
        return {"w_x": (in_features, 3 * h), "b_x": (3 * h,), "w_h": (h, 3 * h), "b_hn": (h,)}

    def init(self, key: PRNGKey, in_features: int) -> Params:
        """Parameters for inputs with `in_features` features, each gate's block drawn on its own."""
        k_x, k_bx, k_h, k_bh = jax.random.split(key, 4)
        h = self.features
        return {
            "w_x": _per_gate(self.kernel_init, k_x, (in_features, h), 3),
            "b_x": _per_gate(self.bias_init, k_bx, (h,), 3),
            "w_h": _per_gate(self.recurrent_init, k_h, (h, h), 3),
            "b_hn": self.bias_init(k_bh, (h,), jnp.float32),
        }

    def initial_carry(self, batch_shape: Shape, dtype: DTypeLike = jnp.float32) -> Carry:
        """`h`, zeros of shape (*batch_shape, features)."""
        return jnp.zeros((*batch_shape, self.features), dtype)

    def step(self, params: Params, carry: Carry, x_t: jax.Array, policy: Policy | None = None) -> tuple[Carry, Any]:
        """One step: `(h', h')`, the carry in its own dtype and the output in `x_t`'s."""
        h = carry
        zx = precision.dense(x_t, params["w_x"], policy)
        zx = zx + _bias(params["b_x"], zx)
        zh = precision.dense(h.astype(x_t.dtype), params["w_h"], policy)
        xr, xz, xn = jnp.split(zx, 3, axis=-1)
        hr, hz, hn = jnp.split(zh, 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * (hn + _bias(params["b_hn"], hn)))
        new_h = (1.0 - z) * n + z * h.astype(n.dtype)
        return new_h.astype(h.dtype), new_h.astype(x_t.dtype)


# reverse flag of each RNN layer built here, by its apply function, so that `Bidirectional` can refuse a backward
# layer that runs forward (which would silently compute two forward passes).
_RNN_REVERSE: weakref.WeakKeyDictionary[ApplyFn, bool] = weakref.WeakKeyDictionary()


def _check_mask(name: str, mask: Any, x_shape: Shape) -> jax.Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape != tuple(x_shape[:2]):
        raise LayerError(
            name,
            f"expected a (batch, time) mask of shape {tuple(x_shape[:2])} for input of shape {tuple(x_shape)}, "
            f"got mask of shape {mask.shape}",
        )
    if mask.dtype != jnp.bool_:
        raise LayerTypeError(
            name, f"expected a bool mask (True for real steps), got dtype {mask.dtype}; pass mask.astype(bool)"
        )
    return mask


def _scan(
    cell: Cell, params: Params, x_BTF: jax.Array, mask_BT: jax.Array | None, reverse: bool, policy: Policy | None
) -> tuple[Carry, jax.Array]:
    """The cell over time: `(final carry, (B, T, features) outputs)`."""
    carry = cell.initial_carry(x_BTF.shape[:1], accumulation_dtype(x_BTF.dtype))
    x_TBF = jnp.swapaxes(x_BTF, 0, 1)

    if mask_BT is None:

        def body(carry, x_t):
            return cell.step(params, carry, x_t, policy)

        carry, y_TBH = lax.scan(body, carry, x_TBF, reverse=reverse)
    else:

        def masked_body(carry, inputs):
            x_t, m_B = inputs
            new_carry, y_t = cell.step(params, carry, x_t, policy)
            m_B1 = m_B[:, None]
            carry = jax.tree.map(lambda new, old: jnp.where(m_B1, new, old), new_carry, carry)
            return carry, jnp.where(m_B1, y_t, jnp.zeros_like(y_t))

        carry, y_TBH = lax.scan(masked_body, carry, (x_TBF, jnp.swapaxes(mask_BT, 0, 1)), reverse=reverse)
    return carry, jnp.swapaxes(y_TBH, 0, 1)


# Outside jit, `lax.scan` traces and compiles its body afresh on every call (the body is a new closure each time);
# under `jax.jit` with the cell static, a second call of the same shapes reuses the compiled scan. Nested in an
# outer jit it is inlined as usual.
_scan_jit = jax.jit(_scan, static_argnames=("cell", "reverse", "policy"))


def _run_scan(
    cell: Cell, params: Params, x_BTF: jax.Array, mask_BT: jax.Array | None, reverse: bool, policy: Policy | None
) -> tuple[Carry, jax.Array]:
    try:
        hash((cell, policy))
    except TypeError:  # a cell of the user's that is not hashable cannot be a static argument
        return _scan(cell, params, x_BTF, mask_BT, reverse, policy)
    return _scan_jit(cell, params, x_BTF, mask_BT, reverse=reverse, policy=policy)


@describe
def RNN(cell: Cell, *, reverse: bool = False, return_carry: bool = False, name: str = "rnn") -> Layer:
    """`cell` scanned over the time axis of (B, T, F) inputs; returns (B, T, cell.features), in the input order
    even when `reverse=True` (which reads each row from its last real step back to its first).

    Side input `mask` ((B, T) bool, True for real steps, padding at the end of each row): padded steps leave the
    carry as it was and output zeros. With `return_carry=True`, `apply` returns `(final_carry, outputs)` and `init`
    the output shape `(carry_shapes, (B, T, features))`; the final carry is the one at each row's last real step
    (its first, when reversed), computed in float32 or wider.
    """

    def init(key, in_shape):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        batch, time, in_features = in_shape
        params = cell.init(key, in_features)
        out_shape = (batch, time, cell.features)
        if not return_carry:
            return out_shape, params
        carry = jax.eval_shape(lambda: cell.initial_carry((batch,), jnp.float32))
        return (jax.tree.map(lambda s: tuple(s.shape), carry), out_shape), params

    def apply(params, x, *, policy=None, mask=None, **kwargs):
        check_keywords(name, kwargs, _SIDE_INPUTS)
        check_float_input(name, x)
        if x.ndim != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", x.shape)
        check_params(name, params, cell.param_shapes(x.shape[-1]))
        carry, y = _run_scan(cell, params, x, _check_mask(name, mask, x.shape), reverse, policy)
        return (carry, y) if return_carry else y

    apply = with_name(name, apply)
    _RNN_REVERSE[apply] = reverse
    return Layer(with_name(name, init), apply, name, side_inputs=_SIDE_INPUTS)


def _check_direction(layer: Layer, reverse: bool, arg: str) -> None:
    built_reverse = _RNN_REVERSE.get(layer.apply)
    if built_reverse is not None and built_reverse != reverse:
        runs, wanted = ("backward", "False") if built_reverse else ("forward", "True")
        raise ValueError(f"Bidirectional: {arg} runs {runs}; build it with RNN(cell, reverse={wanted})")


@describe
def Bidirectional(forward_rnn: Layer, backward_rnn: Layer, *, name: str = "bidirectional") -> Layer:
    """Both directions over (B, T, F) inputs, their outputs concatenated on the last axis: (B, T, H_f + H_b).

    `backward_rnn` must run backwards (`RNN(cell, reverse=True)`). Params sit under "forward" and "backward"; the
    side input `mask` goes to both. When both RNNs return their carry, `apply` returns
    `((carry_forward, carry_backward), outputs)`.
    """
    if forward_rnn.stateful or backward_rnn.stateful:
        raise ValueError("Bidirectional: takes stateless layers (RNNs); a layer with state cannot be a direction")
    _check_direction(forward_rnn, False, "forward_rnn")
    _check_direction(backward_rnn, True, "backward_rnn")
    directions = (("forward", forward_rnn), ("backward", backward_rnn))

    def init(key, in_shape):
        params: dict[str, Params] = {}
        outs: list[Any] = []
        for i, (key_name, layer) in enumerate(directions):
            with as_child(key_name, layer):
                out, params[key_name] = layer.init(jax.random.fold_in(key, i), tuple(in_shape))
            outs.append(out)
        # A shape is a tuple of ints; an RNN returning its carry has (carry_shapes, shape) instead.
        with_carry = [not isinstance(out[0], int) for out in outs]
        if with_carry[0] != with_carry[1]:
            raise LayerError(name, "one direction returns its carry and the other not; build both alike")
        if not with_carry[0]:
            return (*outs[0][:-1], outs[0][-1] + outs[1][-1]), params
        (carry_f, out_f), (carry_b, out_b) = outs
        return ((carry_f, carry_b), (*out_f[:-1], out_f[-1] + out_b[-1])), params

    def apply(params, x, *, key=None, train=False, policy=None, mask=None, **kwargs):
        check_keywords(name, kwargs, _SIDE_INPUTS)
        if not isinstance(params, dict):
            raise LayerError(name, f"expected params as a dict with 'forward' and 'backward', got {type(params)}")
        side = {"mask": mask} if mask is not None else {}
        ys = []
        for i, (key_name, layer) in enumerate(directions):
            child_key = None if key is None else jax.random.fold_in(key, i)
            child_side = {k: v for k, v in side.items() if k in layer.side_inputs}
            with as_child(key_name, layer):
                ys.append(
                    layer.apply(params.get(key_name, {}), x, key=child_key, train=train, policy=policy, **child_side)
                )
        if isinstance(ys[0], tuple) and isinstance(ys[1], tuple):
            (carry_f, y_f), (carry_b, y_b) = ys
            return (carry_f, carry_b), jnp.concatenate([y_f, y_b], axis=-1)
        return jnp.concatenate(ys, axis=-1)

    return Layer(with_name(name, init), with_name(name, apply), name, side_inputs=_SIDE_INPUTS)
