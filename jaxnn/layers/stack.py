"""Deep stacks: one layer's parameters repeated and scanned over (`Repeat`), and rematerialisation (`remat`).

A flat `serial(block, block, ...)` traces, and XLA compiles, every block separately: compile time grows with
depth. `Repeat` stacks the blocks' parameters along a leading axis and runs one traced block inside `lax.scan`,
so compile time stays flat as the model deepens (docs/layers.md has the measurement). `remat` recomputes a
layer's activations in the backward pass instead of keeping them (`jax.checkpoint`): memory for compute.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxnn.layers.core import Layer, LayerError, check_keywords, check_positive, describe, run, run_cached, with_name
from jaxnn.layers.core import init_cache as init_cache_of

# The keywords `remat` hands through as static Python values; everything else (arrays) goes through
# jax.checkpoint as arguments.
_STATIC = ("train", "policy")


# Rematerialisation policies by name: what the backward pass keeps of a remat layer's forward (the rest it
# recomputes). "offload" moves the kept products to host memory instead of holding them on the device.
REMAT_POLICIES: dict[str, Any] = {
    "nothing": jax.checkpoint_policies.nothing_saveable,  # keep only the layer's inputs: least memory, most compute
    "dots": jax.checkpoint_policies.dots_saveable,  # keep every matmul output, recompute the elementwise work
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the weight products only
    "everything": jax.checkpoint_policies.everything_saveable,  # keep all: as without remat (a reference point)
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def remat_policy(policy: Any) -> Any:
    """A `jax.checkpoint` policy from its name in `REMAT_POLICIES` (a policy function or None is kept as is)."""
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str) and policy in REMAT_POLICIES:
        return REMAT_POLICIES[policy]
    raise ValueError(
        f"remat: unknown policy {policy!r}; choose one of {', '.join(REMAT_POLICIES)} or a jax.checkpoint_policies "
        "function"
    )


@describe
def remat(layer: Layer, *, checkpoint_policy: Any = None) -> Layer:
    """`layer` with its activations recomputed in the backward pass (`jax.checkpoint`): by default the backward
    pass keeps only the layer's inputs, at the cost of running its forward twice. `checkpoint_policy` says what
    else to keep: a name in `REMAT_POLICIES` ("nothing", "dots", "dots_no_batch", "everything", "offload") or one
    of `jax.checkpoint_policies`."""
    policy = remat_policy(checkpoint_policy)

    def apply(params, x, **kwargs):
        static = {k: kwargs.pop(k) for k in _STATIC if k in kwargs}

        def body(params, x, arrays):
            return layer.apply(params, x, **static, **arrays)

        return jax.checkpoint(body, policy=policy)(params, x, kwargs)

    return layer._replace(apply=apply)


# Layers that take a `remat` policy themselves and apply it to each copy or block they hold.
_TAKES_REMAT = ("jaxnn.layers.stack.Repeat", "jaxnn.layers.transformer.TransformerBlock")


def rematerialised(model: Layer, policy: str) -> Layer:
    """`model` with its activations recomputed in the backward pass under the named `policy`, layer by layer (what
    `jaxnn.fit(remat=)` trains): a model built from a config with a `remat` field (GPT) is rebuilt with it; a
    `serial` model gets each of its layers recomputed, a `Repeat` or `TransformerBlock` among them per copy or
    block. Parameters keep their structure. Any other model is refused in one line (wrap its blocks in `remat`):
    rematerialising a whole model at once saves nothing, since its backward pass recomputes every activation."""
    remat_policy(policy)
    spec = model.spec
    if spec is None:
        raise ValueError(f"remat={policy!r}: {model.name!r} records no constructor to rebuild it from; {_WRAP}")
    config: Any = spec.args[0] if len(spec.args) == 1 and not spec.kwargs else None
    if _has_remat_field(config):
        return _constructor(spec.path)(dataclasses.replace(config, remat=policy))
    if spec.path == "jaxnn.layers.combinators.serial":
        layers = [_per_block(child, policy) for child in spec.args]
        return _constructor(spec.path)(*layers, **spec.kwargs)
    raise ValueError(
        f"remat={policy!r}: cannot rematerialise {model.name!r} layer by layer (it is neither a serial model nor "
        f"built from a config with a remat field); {_WRAP}"
    )


_WRAP = "wrap its blocks in jaxnn.layers.remat(block, checkpoint_policy=...)"


def _has_remat_field(config: Any) -> bool:
    return (
        dataclasses.is_dataclass(config)
        and not isinstance(config, type)
        and "remat" in {f.name for f in dataclasses.fields(config)}
    )


def _per_block(layer: Layer, policy: str) -> Layer:
    if layer.spec is not None and layer.spec.path in _TAKES_REMAT:
        return _constructor(layer.spec.path)(*layer.spec.args, **{**layer.spec.kwargs, "remat": policy})
    return remat(layer, checkpoint_policy=policy)


def _constructor(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _stacked(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def _scan(layer, num_layers, unroll, train, policy, params, x, state, key, side):
    def step(x, per_layer):
        p, s, i = per_layer
        layer_key = None if key is None else jax.random.fold_in(key, i)
        return run(layer, p, x, state=s, key=layer_key, train=train, policy=policy, **side)

    return lax.scan(step, x, (params, state, jnp.arange(num_layers)), unroll=unroll)


def _decode(layer, num_layers, unroll, policy, params, x, state, cache, side):
    def step(x, per_layer):
        p, s, c = per_layer
        return run_cached(layer, p, x, c, state=s, policy=policy, **side)

    return lax.scan(step, x, (params, state, cache), length=num_layers, unroll=unroll)


remat_layer = remat  # for constructors whose own `remat` keyword hides the function

# Under jax.jit with the layer static, an eager call reuses the scan compiled for the same shapes (a fresh closure
# passed to lax.scan would be traced and compiled on every call); nested in an outer jit it is inlined.
_scan_jit = jax.jit(_scan, static_argnums=(0, 1, 2, 3, 4))
_decode_jit = jax.jit(_decode, static_argnums=(0, 1, 2, 3))


@describe
def Repeat(layer: Layer, num_layers: int, *, unroll: int = 1, remat: Any = None, name: str = "repeat") -> Layer:
    """`num_layers` copies of `layer` (each with its own parameters) applied in sequence inside one `lax.scan`.

    Params, state and cache are the layer's with a leading `num_layers` axis; layer i is initialised with
    `fold_in(key, i)` and gets `fold_in(key, i)` for dropout, as the i-th child of a `serial` would. The layer must
    keep the shape of its input. Side inputs reach every copy. `unroll` is lax.scan's (more unrolling: longer
    compile, sometimes a faster step). `remat`: a policy (see `remat`) under which each copy's activations are
    recomputed in the backward pass."""
    check_positive("Repeat", num_layers=num_layers)
    if remat is not None:
        layer = remat_layer(layer, checkpoint_policy=remat)

    def init(key, in_shape):
        def one(i):
            out_shape, params = layer.init(jax.random.fold_in(key, i), tuple(in_shape))
            if tuple(out_shape) != tuple(in_shape):
                raise LayerError(
                    name, f"the repeated layer maps {tuple(in_shape)} to {tuple(out_shape)}; it must keep it"
                )
            return params

        return tuple(in_shape), jax.vmap(one)(jnp.arange(num_layers))

    def init_state(in_shape):
        assert layer.init_state is not None  # installed for a stateful layer only
        return _stacked(layer.init_state(tuple(in_shape)), num_layers)

    def init_cache(in_shape, max_len, dtype):
        return _stacked(init_cache_of(layer, tuple(in_shape), max_len, dtype), num_layers)

    def apply(params, x, *, state=None, key=None, train=False, policy=None, cache=None, **side):
        check_keywords(name, side, layer.side_inputs)
        if cache is not None:
            return _decode_jit(layer, num_layers, unroll, policy, params, x, state, cache, side)
        x, new_state = _scan_jit(layer, num_layers, unroll, train, policy, params, x, state, key, side)
        return (x, new_state) if layer.stateful else x

    return Layer(
        with_name(name, init),
        with_name(name, apply),
        name,
        init_state if layer.stateful else None,
        side_inputs=layer.side_inputs,
        init_cache=init_cache if layer.init_cache is not None else None,
        expands=lambda in_shape: (layer, num_layers),
    )
