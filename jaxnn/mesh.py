"""Devices, meshes, shardings and placement: where arrays live, from one CPU to many processes.

This module imports nothing else from jaxnn but `jaxnn.sharding` and the rule modules below it, so every part
of the library (the training loop, the data-parallel forms, checkpoints, benchmarks) can place arrays the same way
without import cycles. A mesh may carry `fsdp` and `tensor` axes besides `data` (`jaxnn.sharding`): the batch is
then split over data x fsdp and the train state by the sharding rules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxnn import sharding
from jaxnn.pytree import is_prng_key
from jaxnn.shard_rules import RulesLike

log = logging.getLogger(__name__)

DATA_AXIS = "data"


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
        raise RuntimeError(
            f"configure_cpu_devices({num_devices}) called after jax started with "
            f"{jax.local_device_count()} devices; call it before any jax computation"
        ) from None
    # The XLA flag (set by tests/conftest.py) would override the option, so it must not contradict it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" in flags:
        os.environ["XLA_FLAGS"] = " ".join(
            f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")
        )


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
    """Leading (batch) axis split over `data` (and `fsdp`, where the mesh has it), every other axis whole."""
    axes = sharding.batch_axes(mesh)
    return NamedSharding(mesh, P(axes[0] if len(axes) == 1 else axes))


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the batch axes' sizes."""
    return int(np.prod([mesh.shape[a] for a in sharding.batch_axes(mesh)]))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that keeps a whole copy on every device of `mesh`."""
    return NamedSharding(mesh, P())


def check_batch_divisible(global_batch: int, mesh: Mesh) -> None:
    """Refuses a global batch the batch axes cannot split evenly."""
    n = batch_devices(mesh)
    if global_batch % n:
        axes = " x ".join(sharding.batch_axes(mesh))
        raise ValueError(f"batch size {global_batch} is not divisible by the {n} devices of the {axes} axis")


def leading_size(batch: Any) -> int:
    """The first-axis size every leaf of `batch` shares (ValueError naming the sizes otherwise)."""
    sizes: set[int | None] = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    size = next(iter(sizes)) if len(sizes) == 1 else None
    if size is None:
        raise ValueError(
            f"batch leaves must share one leading (batch) axis, got leading sizes {sorted(map(str, sizes))}"
        )
    return size


# --------------------------------------------------------------------------------------------------- placement


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places this process's part of a global batch straight onto the `data` sharding of `mesh`.

    With one process `batch` is the whole global batch; with several, each passes its own equal slice (the
    global batch is their concatenation in process order). Each device receives only its shard: nothing is
    gathered on one device first.
    """
    local = leading_size(batch)
    check_batch_divisible(local * jax.process_count(), mesh)
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def _put_leaf(x: Any, sharding: NamedSharding) -> Any:
    if is_prng_key(x):
        data = _put_leaf(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
        x = np.asarray(x)  # a process-local array must come through the host to join a multi-process array
    return jax.device_put(x, sharding)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Copies `tree` (every process passing the same values) onto every device of `mesh`."""
    sharding = replicated(mesh)
    return jax.tree.map(lambda x: _put_leaf(x, sharding), tree)


def create_sharded_state(create: Callable[[], Any], mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """Runs `create()` (e.g. `lambda: create_train_state(model, tx, key, in_shape)`) straight into replicated arrays
    (or into the sharding rules' shards, on a mesh with fsdp or tensor axes).

    The one way jaxnn creates a train state for a mesh (the loop, experiments and benchmarks alike): compiled
    with `out_shardings`, so every device builds its copy in place, and every process runs the same computation,
    so no process sends its copy to the others. `rules` (see `jaxnn.shard_rules`; default the built-in table) say
    where each parameter goes; given rules are applied (and reported on) on any mesh.
    """
    if sharding.shards_state(mesh) or rules is not None:
        return sharding.create_state(create, mesh, rules)
    return jax.jit(create, out_shardings=replicated(mesh))()


def place_state(state: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """`state` on `mesh`: replicated, or sharded by the rules when the mesh shards the state or rules are given."""
    if sharding.shards_state(mesh) or rules is not None:
        return sharding.place_state(state, mesh, rules)
    return replicate(state, mesh)


# ------------------------------------------------------------------------------------------------------ many hosts

ENV_COORDINATOR = "JAXNN_COORDINATOR"  # host:port of process 0's coordinator service
ENV_NUM_PROCESSES = "JAXNN_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXNN_PROCESS_ID"
ENV_K8S_INDEX = "JOB_COMPLETION_INDEX"  # the process id's fallback, set by Kubernetes in an indexed Job's pods


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 30,
    init_timeout_s: int = 120,
) -> bool:
    """Joins this process to a multi-process run; call before any jax computation. Returns whether it did.

    Arguments left None come from `JAXNN_COORDINATOR`, `JAXNN_NUM_PROCESSES` and `JAXNN_PROCESS_ID` (or, given the
    first two, from Kubernetes' `JOB_COMPLETION_INDEX`, so one pod spec serves every pod of an indexed Job or
    JobSet); when none is given anywhere, jax's own cluster detection (SLURM, Open MPI, TPU pods) fills them in.
    One process is not a distributed run, so `num_processes == 1` does nothing. If a process dies, the others are
    terminated by jax's coordination service, with an error naming the dead task, within about `heartbeat_timeout_s`.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if process_id is None and (coordinator or num_processes is not None):
        # Kubernetes numbers the pods of an indexed Job (and a JobSet's) in this variable: each pod's process id.
        process_id = _env_int(ENV_K8S_INDEX)
    if num_processes == 1:
        return False
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(
            f"initialize_distributed: {', '.join(missing)} missing (give all of coordinator, "
            f"num_processes and process_id, by flag or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/"
            f"{ENV_PROCESS_ID}, or none of them for cluster auto-detection)"
        )
    if num_processes is not None:
        assert process_id is not None  # given num_processes, the check above made process_id given too
        if not 0 <= process_id < num_processes:
            raise ValueError(f"initialize_distributed: process_id {process_id} is not in [0, {num_processes})")
    # CPU processes exchange data through gloo (over TCP); GPUs and TPUs ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except ValueError as e:
        if coordinator is None:
            raise ValueError(
                f"initialize_distributed: no coordinator given (flag or {ENV_COORDINATOR}) and no cluster detected: {e}"
            ) from e
        raise
    log.info(
        "process %d of %d joined (coordinator %s); %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        coordinator or "auto-detected",
        jax.local_device_count(),
        jax.device_count(),
    )
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
    starts, stops = [], []
    for idx in index_map.values():
        assert idx is not None  # a NamedSharding gives every device an index
        starts.append(idx[0].start or 0)
        stops.append(idx[0].stop or global_batch_size)
    rows = slice(min(starts), max(stops))
    if (rows.stop - rows.start) * jax.process_count() != global_batch_size:
        raise ValueError(
            f"the devices of process {jax.process_index()} do not hold one contiguous share of the "
            "batch; build the mesh with make_mesh, which orders devices by process"
        )
    return rows
