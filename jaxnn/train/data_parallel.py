"""Data-parallel training in three forms that compute the same step.

- `"jit"` (the default): `jax.jit` with `NamedSharding`; the batch is split over the mesh's `data` axis, the train
  state is replicated, and XLA inserts the gradient all-reduce itself.
- `"shard_map"`: `jax.shard_map` runs the step per device on its shard; gradients are averaged across devices
  with an explicit collective, and the metrics with `lax.pmean`.
- `"pmap"`: the older `jax.pmap` form (state carries a leading device axis), kept for comparison and migration.

All three build on `jaxnn.train.train_step_fn` (and jit through `jaxnn.train.step.jit_step`);
`data_parallel_train_step` returns a `DataParallelStep` whose `place_state`/`place_batch`/`step` hide the
differences, so the training loop is the same for every form and for one device, eight devices, or many processes.
Meshes, placement and multi-process start-up live in `jaxnn.parallel` (the sharding vocabulary, below the layers);
this step lives above them, with the rest of training. It was the module `forms` of `jaxnn.parallel` (an attribute
there still, deprecated, until 0.2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxnn import fp8
from jaxnn._src.pytree import is_prng_key
from jaxnn.layers.core import Layer
from jaxnn.parallel.mesh import (
    DATA_AXIS,
    batch_sharding,
    check_batch_divisible,
    leading_size,
    make_mesh,
    replicated,
    shards_state,
)
from jaxnn.parallel.placement import place_state, shard_batch
from jaxnn.precision import Policy
from jaxnn.train.state import AugmentFn, Batch, LossFn, Metrics, StepFn, TrainState
from jaxnn.train.step import jit_step, train_step_fn

log = logging.getLogger(__name__)

# The forms `fit` runs: their state has the model's own shapes, where pmap's carries a device axis in front (kept
# here for comparison, not for checkpointed runs). `jaxnn.config.FitConfig` checks its `form` against them.
FIT_FORMS = ("jit", "shard_map")
FORMS = (*FIT_FORMS, "pmap")


def _stack_for_pmap(tree: Any, mesh: Mesh) -> Any:
    # pmap (a shard_map over a 1-D mesh of these devices) reads this layout without moving anything.
    n = mesh.shape[DATA_AXIS]
    sharding = batch_sharding(mesh)

    def stack(x):
        if is_prng_key(x):
            return jax.random.wrap_key_data(stack(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return jax.device_put(np.broadcast_to(np.asarray(x), (n, *np.shape(x))), sharding)

    return jax.tree.map(stack, tree)


def _split_for_pmap(batch: Any, mesh: Mesh) -> Any:
    n = mesh.shape[DATA_AXIS]
    check_batch_divisible(leading_size(batch), mesh)
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x).reshape(n, -1, *np.shape(x)[1:]), sharding), batch)


# ------------------------------------------------------------------------------------------------- the step forms


def bn_axis_name(form: str = "shard_map", cross_replica: bool = True) -> str | None:
    """The `axis_name` to build `BatchNorm` with for `form`: `BatchNorm(axis_name=bn_axis_name(form, flag))`.

    shard_map and pmap see one shard per device, so cross-replica statistics need the `data` axis and per-device
    statistics need None. Under `jit` the model sees the whole logical batch, so its statistics are always global
    (the cross-replica result) and the axis name must be None.
    """
    _check_form(form)
    if form == "jit":
        if not cross_replica:
            raise ValueError(
                "form 'jit' always computes BatchNorm statistics over the global batch; "
                "use form 'shard_map' or 'pmap' for per-device statistics"
            )
        return None
    return DATA_AXIS if cross_replica else None


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown data-parallel form {form!r}; choose one of {FORMS}")


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _pmean_floats(tree: Any, axis_name: str) -> Any:
    return jax.tree.map(lambda x: lax.pmean(x, axis_name) if _is_float(x) else x, tree)


def _grads_summed_over(model: Layer, axis_name: str) -> Layer:
    """`model` whose parameter gradients come out summed over `axis_name` (an identity with a psum backward).

    Reducing where the parameters enter the model, rather than inside the optimiser, means the step's gradient
    norm, overflow check and update all see the global gradient, exactly as on one device.
    """

    @jax.custom_vjp
    def global_grads(params):
        return params

    def reduce(path, g):
        if fp8.is_history(path):  # an fp8 amax history updated with each device's maxima: the largest is global
            return lax.pmax(g, axis_name)
        # Reduce in float32 so that bf16/fp16 compute does not lose the sum's precision.
        return lax.psum(g.astype(jnp.float32), axis_name).astype(g.dtype)

    def backward(_, grads):
        return (jax.tree_util.tree_map_with_path(reduce, grads),)

    global_grads.defvjp(lambda params: (params, None), backward)

    def apply(params, x, **kwargs):
        return model.apply(global_grads(params), x, **kwargs)

    return model._replace(apply=apply)


def _share_of_global_mean(loss_fn: LossFn, axis_name: str) -> LossFn:
    def loss(logits, batch):
        value, metrics = loss_fn(logits, batch)
        return value / lax.axis_size(axis_name), metrics

    return loss


def per_device_step_fn(
    model: Layer,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    axis_name: str = DATA_AXIS,
    accumulate: int = 1,
    augment: AugmentFn | None = None,
) -> StepFn:
    """The step one device runs inside `shard_map`/`pmap` over `axis_name`: `(state, local_batch) -> (state, metrics)`.

    The gradient is the explicit average over devices of each device's gradient of its local mean loss. It is
    computed as a psum of the gradients of (local mean / device count), which is the same average, but keeps every
    intermediate gradient the size it has on one device, so fp16 loss scaling overflows exactly when one device
    would. `loss_fn` must be a mean over the examples (equal shards make the global mean the mean of local ones).
    Metrics are averaged (`lax.pmean`), and so is the model state (BatchNorm running statistics), which keeps it
    identical everywhere even with per-device statistics. Each device draws its own randomness (dropout) from
    `fold_in(key, device index)`; `augment` runs on the local rows numbered by their place in the global batch,
    with the run's own key, so each example is augmented as on one device.
    """
    step = train_step_fn(
        _grads_summed_over(model, axis_name),
        _share_of_global_mean(loss_fn, axis_name),
        tx,
        policy,
        accumulate=accumulate,
    )

    def per_device(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if augment is not None:
            rows = jax.tree.leaves(batch)[0].shape[0]
            batch = augment(batch, state.key, state.step, lax.axis_index(axis_name) * rows)
        device_key = jax.random.fold_in(state.key, lax.axis_index(axis_name))
        new_state, metrics = step(state._replace(key=device_key), batch)
        new_state = new_state._replace(key=state.key, model_state=_pmean_floats(new_state.model_state, axis_name))
        metrics = {**_pmean_floats(metrics, axis_name), "loss": lax.psum(metrics["loss"], axis_name)}
        return new_state, metrics

    return per_device


class DataParallelStep(NamedTuple):
    """A compiled data-parallel step and the placement that goes with its form.

    Usage (identical for every form):
        dp = data_parallel_train_step(model, loss_fn, tx, mesh=mesh, form=form)
        state = dp.place_state(state)
        for batch in batches:                       # this process's numpy part of each global batch
            state, metrics = dp.step(state, dp.place_batch(batch))
        state = dp.unreplicate(state)               # one copy, for evaluation and checkpoints
    """

    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    place_state: Callable[[TrainState], TrainState]
    place_batch: Callable[[Any], Any]
    unreplicate: Callable[[TrainState], TrainState]
    mesh: Mesh
    form: str
    # The compiled step's temporary bytes on (state, batch), XLA's memory analysis (form "jit" only); the compile
    # is the one the step itself then runs.
    temp_bytes: Callable[[TrainState, Any], int] | None = None


def data_parallel_train_step(
    model: Layer,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    mesh: Mesh | None = None,
    form: str = "jit",
    donate: bool = True,
    accumulate: int = 1,
    augment: AugmentFn | None = None,
) -> DataParallelStep:
    """Data-parallel training over the `data` axis of `mesh` (all devices by default) in `form` (see `FORMS`).

    For BatchNorm models build the model with `BatchNorm(axis_name=bn_axis_name(form, cross_replica))`.
    The returned `step` refuses a batch whose size the device count does not divide. `accumulate=K` averages the
    gradients of K micro-batches per update (`jaxnn.train.train_step_fn`); form "pmap" does not take it.
    `augment` (see `jaxnn.train.AugmentFn`) transforms each batch inside the step, identically in every form.
    """
    _check_form(form)
    mesh = make_mesh() if mesh is None else mesh
    if form != "jit" and shards_state(mesh):
        raise ValueError(f"form {form!r} is data parallelism only; a mesh with fsdp or tensor axes needs form 'jit'")

    if form == "pmap":
        if accumulate != 1:
            raise ValueError("form 'pmap' does not accumulate gradients; use 'jit' or 'shard_map'")
        if jax.process_count() > 1:
            raise ValueError(
                "form 'pmap' is kept for single-process comparison; use 'jit' or 'shard_map' across processes"
            )
        pmapped = jax.pmap(
            per_device_step_fn(model, loss_fn, tx, policy, augment=augment),
            axis_name=DATA_AXIS,
            devices=list(mesh.devices.flat),
            donate_argnums=(0,) if donate else (),
            out_axes=(0, None),
        )  # metrics are identical on every device after their pmean

        def pmap_step(state, batch):
            _check_pmap_batch(batch, mesh)
            return pmapped(state, batch)

        return DataParallelStep(
            pmap_step,
            lambda s: _stack_for_pmap(s, mesh),
            lambda b: _split_for_pmap(b, mesh),
            lambda s: jax.tree.map(lambda x: x[0], s),
            mesh,
            form,
        )

    if form == "jit":
        step = train_step_fn(model, loss_fn, tx, policy, accumulate=accumulate, augment=augment)
        return _jit_step(step, mesh, form, donate)
    body = jax.shard_map(
        per_device_step_fn(model, loss_fn, tx, policy, accumulate=accumulate, augment=augment),
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS)),
        out_specs=(P(), P()),
        # The gradient average is the explicit psum in per_device_step_fn; with
        # check_vma=True, autodiff would also sum the replicated parameters' gradients.
        check_vma=False,
    )
    return _jit_step(body, mesh, form, donate)


def _jit_step(body: StepFn, mesh: Mesh, form: str, donate: bool) -> DataParallelStep:
    """`body` jitted with the batch split over the batch axes and the state where it lies: replicated, or sharded
    by the rules (`jaxnn.parallel.placement`). The state's shardings are read from the first state the step gets
    (the one placed by `place_state` or created by `create_sharded_state`), and the new state keeps them, so
    parameters and optimizer moments stay where they are from step to step."""
    compiled: list[Any] = []
    # The built-in blocks' activation constraints (`jaxnn.parallel.activations`) read the mesh in context; data
    # parallelism needs none, and its tiny models' steps keep their dispatch time.
    context = (lambda: jax.set_mesh(mesh)) if shards_state(mesh) else contextlib.nullcontext

    def jitted(state):
        if not compiled:  # compiled once: reading the shardings every step would cost tiny models' dispatch time
            shardings = jax.tree.map(lambda x: x.sharding, state)
            compiled.append(
                jit_step(
                    body,
                    donate=donate,
                    in_shardings=(shardings, batch_sharding(mesh)),
                    out_shardings=(shardings, replicated(mesh)),
                )
            )
        return compiled[0]

    def step(state, batch):
        check_batch_divisible(leading_size(batch), mesh)
        with context():
            return jitted(state)(state, batch)

    def temp_bytes(state, batch) -> int:
        with context():
            return int(jitted(state).lower(state, batch).compile().memory_analysis().temp_size_in_bytes)

    return DataParallelStep(
        step, lambda s: place_state(s, mesh), lambda b: shard_batch(b, mesh), lambda s: s, mesh, form, temp_bytes
    )


def _check_pmap_batch(batch: Any, mesh: Mesh) -> None:
    # A pmap batch carries the device axis in front: (devices, per-device batch, ...).
    n = mesh.shape[DATA_AXIS]
    if not all(np.ndim(x) >= 2 and np.shape(x)[0] == n for x in jax.tree.leaves(batch)):
        raise ValueError(
            f"pmap batch leaves must have shape (devices={n}, per-device batch, ...); "
            "place the global batch with DataParallelStep.place_batch"
        )


__all__ = [
    "FIT_FORMS",
    "FORMS",
    "DataParallelStep",
    "bn_axis_name",
    "data_parallel_train_step",
    "per_device_step_fn",
]
