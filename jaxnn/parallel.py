"""Device meshes, shardings, and data-parallel training in three forms that compute the same step.

- `"jit"` (the default): `jax.jit` with `NamedSharding`; the batch is split over the mesh's `data` axis, the train
  state is replicated, and XLA inserts the gradient all-reduce itself.
- `"shard_map"`: `jax.shard_map` runs the step per device on its shard; gradients are averaged across devices
  with an explicit collective, and the metrics with `lax.pmean`.
- `"pmap"`: the older `jax.pmap` form (state carries a leading device axis), kept for comparison and migration.

All three build on `jaxnn.train.train_step_fn`; `data_parallel_train_step` returns a `DataParallelStep` whose
`place_state`/`place_batch`/`step` hide the differences, so the training loop is the same for every form and for
one device, eight devices, or many processes. Multi-process runs start with `initialize_distributed`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxnn.layers.core import Layer
from jaxnn.train import LossFn, TrainState, train_step_fn

log = logging.getLogger(__name__)

DATA_AXIS = "data"
FORMS = ("jit", "shard_map", "pmap")


# --------------------------------------------------------------------------------------------------------- devices

def configure_cpu_devices(num_devices: int) -> None:
    """Simulates `num_devices` CPU devices; call before anything touches a jax device (first in a CLI's main).

    Has no effect on GPU/TPU platforms; refuses once jax's backends exist, since the count is fixed at start.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"configure_cpu_devices: num_devices must be a positive integer, got {num_devices!r}")
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:  # jax's backends already exist: the count is fixed
        if jax.local_device_count() == num_devices or jax.default_backend() != "cpu":
            return
        raise RuntimeError(f"configure_cpu_devices({num_devices}) called after jax started with "
                           f"{jax.local_device_count()} devices; call it before any jax computation") from None
    # The XLA flag (set by tests/conftest.py) would override the option, so it must not contradict it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" in flags:
        os.environ["XLA_FLAGS"] = " ".join(f for f in flags.split()
                                           if not f.startswith("--xla_force_host_platform_device_count"))


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh named `data` over the first `num_devices` devices (all of them by default, across processes)."""
    available = jax.device_count()
    n = available if num_devices is None else num_devices
    if not 1 <= n <= available:
        raise ValueError(f"make_mesh: asked for {num_devices} devices, {available} available")
    # Auto (not the Explicit default): data parallelism leaves sharding propagation to XLA, so model code such as
    # embedding gathers never needs sharding annotations.
    return jax.make_mesh((n,), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over `data`, every other axis whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch_divisible(global_batch: int, mesh: Mesh) -> None:
    """Refuses a global batch the data axis cannot split evenly."""
    n = mesh.shape[DATA_AXIS]
    if global_batch % n:
        raise ValueError(f"batch size {global_batch} is not divisible by the {n} devices of the data axis")


def _leading_size(batch) -> int:
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError("batch leaves must share one leading (batch) axis, got leading sizes "
                         f"{sorted(map(str, sizes))}")
    return sizes.pop()


# --------------------------------------------------------------------------------------------------- placement

def shard_batch(batch, mesh: Mesh):
    """Places this process's part of a global batch straight onto the `data` sharding of `mesh`.

    With one process `batch` is the whole global batch; with several, each passes its own equal slice (the
    global batch is their concatenation in process order). Each device receives only its shard: nothing is
    gathered on one device first.
    """
    local = _leading_size(batch)
    check_batch_divisible(local * jax.process_count(), mesh)
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def _is_key(x) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _put_leaf(x, sharding):
    if _is_key(x):
        data = _put_leaf(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
        x = np.asarray(x)  # a process-local array must come through the host to join a multi-process array
    return jax.device_put(x, sharding)


def replicate(tree, mesh: Mesh):
    """Copies `tree` (every process passing the same values) onto every device of `mesh`."""
    sharding = replicated(mesh)
    return jax.tree.map(lambda x: _put_leaf(x, sharding), tree)


def _stack_for_pmap(tree, mesh: Mesh):
    # pmap (a shard_map over a 1-D mesh of these devices) reads this layout without moving anything.
    n = mesh.shape[DATA_AXIS]
    sharding = batch_sharding(mesh)

    def stack(x):
        if _is_key(x):
            return jax.random.wrap_key_data(stack(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return jax.device_put(np.broadcast_to(np.asarray(x), (n, *np.shape(x))), sharding)

    return jax.tree.map(stack, tree)


def _split_for_pmap(batch, mesh: Mesh):
    n = mesh.shape[DATA_AXIS]
    check_batch_divisible(_leading_size(batch), mesh)
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
            raise ValueError("form 'jit' always computes BatchNorm statistics over the global batch; "
                             "use form 'shard_map' or 'pmap' for per-device statistics")
        return None
    return DATA_AXIS if cross_replica else None


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown data-parallel form {form!r}; choose one of {FORMS}")


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _pmean_floats(tree, axis_name: str):
    return jax.tree.map(lambda x: lax.pmean(x, axis_name) if _is_float(x) else x, tree)


def _grads_summed_over(model: Layer, axis_name: str) -> Layer:
    """`model` whose parameter gradients come out summed over `axis_name` (an identity with a psum backward).

    Reducing where the parameters enter the model, rather than inside the optimiser, means the step's gradient
    norm, overflow check and update all see the global gradient, exactly as on one device.
    """

    @jax.custom_vjp
    def global_grads(params):
        return params

    def backward(_, grads):
        # Reduce in float32 so that bf16/fp16 compute does not lose the sum's precision.
        return (jax.tree.map(lambda g: lax.psum(g.astype(jnp.float32), axis_name).astype(g.dtype), grads),)

    global_grads.defvjp(lambda params: (params, None), backward)

    def apply(params, x, **kwargs):
        return model.apply(global_grads(params), x, **kwargs)

    return Layer(model.init, apply, model.name, model.init_state)


def _share_of_global_mean(loss_fn: LossFn, axis_name: str) -> LossFn:
    def loss(logits, batch):
        value, metrics = loss_fn(logits, batch)
        return value / lax.axis_size(axis_name), metrics

    return loss


def per_device_step_fn(model: Layer, loss_fn: LossFn, tx, policy="fp32", axis_name: str = DATA_AXIS):
    """The step one device runs inside `shard_map`/`pmap` over `axis_name`: `(state, local_batch) -> (state, metrics)`.

    The gradient is the explicit average over devices of each device's gradient of its local mean loss. It is
    computed as a psum of the gradients of (local mean / device count), which is the same average, but keeps every
    intermediate gradient the size it has on one device, so fp16 loss scaling overflows exactly when one device
    would. `loss_fn` must be a mean over the examples (equal shards make the global mean the mean of local ones).
    Metrics are averaged (`lax.pmean`), and so is the model state (BatchNorm running statistics), which keeps it
    identical everywhere even with per-device statistics. Each device draws its own randomness (dropout) from
    `fold_in(key, device index)`.
    """
    step = train_step_fn(_grads_summed_over(model, axis_name), _share_of_global_mean(loss_fn, axis_name), tx, policy)

    def per_device(state: TrainState, batch):
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


def data_parallel_train_step(model: Layer, loss_fn: LossFn, tx, policy="fp32", *, mesh: Mesh | None = None,
                             form: str = "jit", donate: bool = True) -> DataParallelStep:
    """Data-parallel training over the `data` axis of `mesh` (all devices by default) in `form` (see `FORMS`).

    For BatchNorm models build the model with `BatchNorm(axis_name=bn_axis_name(form, cross_replica))`.
    The returned `step` refuses a batch whose size the device count does not divide.
    """
    _check_form(form)
    mesh = make_mesh() if mesh is None else mesh
    donate_argnums = (0,) if donate else ()
    rep, data = replicated(mesh), batch_sharding(mesh)

    if form == "pmap":
        if jax.process_count() > 1:
            raise ValueError("form 'pmap' is kept for single-process comparison; use 'jit' or 'shard_map' "
                             "across processes")
        pmapped = jax.pmap(per_device_step_fn(model, loss_fn, tx, policy), axis_name=DATA_AXIS,
                           devices=list(mesh.devices.flat), donate_argnums=donate_argnums,
                           out_axes=(0, None))  # metrics are identical on every device after their pmean

        def pmap_step(state, batch):
            _check_pmap_batch(batch, mesh)
            return pmapped(state, batch)

        return DataParallelStep(pmap_step, lambda s: _stack_for_pmap(s, mesh), lambda b: _split_for_pmap(b, mesh),
                                lambda s: jax.tree.map(lambda x: x[0], s), mesh, form)

    if form == "jit":
        body = train_step_fn(model, loss_fn, tx, policy)
    else:
        body = jax.shard_map(per_device_step_fn(model, loss_fn, tx, policy), mesh=mesh,
                             in_specs=(P(), P(DATA_AXIS)), out_specs=(P(), P()),
                             # The gradient average is the explicit psum in per_device_step_fn; with
                             # check_vma=True, autodiff would also sum the replicated parameters' gradients.
                             check_vma=False)
    compiled = jax.jit(body, in_shardings=(rep, data), out_shardings=(rep, rep), donate_argnums=donate_argnums)

    def step(state, batch):
        check_batch_divisible(_leading_size(batch), mesh)
        return compiled(state, batch)

    return DataParallelStep(step, lambda s: replicate(s, mesh), lambda b: shard_batch(b, mesh), lambda s: s,
                            mesh, form)


def _check_pmap_batch(batch, mesh: Mesh) -> None:
    # A pmap batch carries the device axis in front: (devices, per-device batch, ...).
    n = mesh.shape[DATA_AXIS]
    if not all(np.ndim(x) >= 2 and np.shape(x)[0] == n for x in jax.tree.leaves(batch)):
        raise ValueError(f"pmap batch leaves must have shape (devices={n}, per-device batch, ...); "
                         "place the global batch with DataParallelStep.place_batch")


def init_replicated_state(create: Callable[[], TrainState], mesh: Mesh) -> TrainState:
    """Runs `create()` (e.g. `lambda: create_train_state(model, tx, key, in_shape)`) straight into replicated arrays.

    Every process runs the same computation, so no process needs to send its copy to the others.
    """
    return jax.jit(create, out_shardings=replicated(mesh))()


# ------------------------------------------------------------------------------------------------------ many hosts

ENV_COORDINATOR = "JAXNN_COORDINATOR"      # host:port of process 0's coordinator service
ENV_NUM_PROCESSES = "JAXNN_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXNN_PROCESS_ID"


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, heartbeat_timeout_s: int = 30,
                           init_timeout_s: int = 120) -> bool:
    """Joins this process to a multi-process run; call before any jax computation. Returns whether it did.

    Arguments left None come from `JAXNN_COORDINATOR`, `JAXNN_NUM_PROCESSES` and `JAXNN_PROCESS_ID`; when none
    is given anywhere, jax's own cluster detection (SLURM, Open MPI, TPU pods) fills them in. One process is
    not a distributed run, so `num_processes == 1` does nothing. If a process dies, the others are terminated
    by jax's coordination service, with an error naming the dead task, within about `heartbeat_timeout_s`.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes == 1:
        return False
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(f"initialize_distributed: {', '.join(missing)} missing (give all of coordinator, "
                         f"num_processes and process_id, by flag or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/"
                         f"{ENV_PROCESS_ID}, or none of them for cluster auto-detection)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"initialize_distributed: process_id {process_id} is not in [0, {num_processes})")
    # CPU processes exchange data through gloo (over TCP); GPUs and TPUs ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=init_timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    except ValueError as e:
        if coordinator is None:
            raise ValueError("initialize_distributed: no coordinator given (flag or "
                             f"{ENV_COORDINATOR}) and no cluster detected: {e}") from e
        raise
    log.info("process %d of %d joined (coordinator %s); %d local of %d devices", jax.process_index(),
             jax.process_count(), coordinator or "auto-detected", jax.local_device_count(), jax.device_count())
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def process_slice(global_batch_size: int, mesh: Mesh) -> slice:
    """The rows of each global batch that this process loads: the rows its devices hold under `shard_batch`."""
    check_batch_divisible(global_batch_size, mesh)
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch_size,))
    starts, stops = zip(*((idx[0].start or 0, idx[0].stop or global_batch_size) for idx in index_map.values()))
    rows = slice(min(starts), max(stops))
    if (rows.stop - rows.start) * jax.process_count() != global_batch_size:
        raise ValueError(f"the devices of process {jax.process_index()} do not hold one contiguous share of the "
                         "batch; build the mesh with make_mesh, which orders devices by process")
    return rows
