"""Devices and meshes: simulated CPU devices, the one mesh builder, the batch's axes, and joining a multi-process run.

A mesh has up to three named axes, always in this order:
- `data`: the batch is split over it; parameters are replicated along it (data parallelism).
- `fsdp`: the batch is split over it too, and so is every parameter and optimizer moment large enough, along one
  dimension (fully sharded data parallelism, ZeRO-3): each device stores 1/fsdp of the state, and XLA gathers a
  layer's parameters when the step uses them and reduce-scatters their gradients.
- `tensor`: tensor parallelism, where a rule table (`jaxnn.parallel.rules`) says which parameter dimensions it
  splits.
Where arrays go on a mesh is `jaxnn.parallel.placement`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxnn.parallel.rules import AXES, DATA, FSDP, TENSOR

log = logging.getLogger(__name__)

DATA_AXIS = DATA

BATCH_AXES = (DATA, FSDP)  # the axes the batch is split over


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data=2,fsdp=4"` (or a mapping) -> {"data": 2, "fsdp": 4}.

    Strict, one line per mistake naming the item: an axis outside (data, fsdp, tensor), an axis given twice, a
    size that is not a positive integer, an empty item or an empty spec.
    """
    items = _mesh_items(spec) if isinstance(spec, str) else list(_mapping_items(spec))
    unknown = [name for name, _ in items if name not in AXES]
    if unknown:
        raise ValueError(f"mesh {spec!r}: axes must be among {AXES}, got {unknown}")
    sizes: dict[str, int] = {}
    for name, size in items:
        if name in sizes:
            raise ValueError(f"mesh {spec!r}: axis {name!r} is given twice")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh {spec!r}: the size of {name!r} must be a positive integer, got {size!r}")
        sizes[name] = size
    if not sizes:
        raise ValueError(f"mesh {spec!r}: no axes given; expected AXIS=SIZE items, e.g. data=2,fsdp=4")
    return sizes


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A mesh's axis sizes, read once from its text where a run starts (`parse`) and passed on typed: `make_mesh`
    builds it, `devices` says how many devices it spans, `batch_split` how many ways it splits the batch. An
    axis a spec leaves out has size 1."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        parse_mesh(dataclasses.asdict(self))  # the sizes are checked as the text's are, naming the axis

    @classmethod
    def parse(cls, spec: str | Mapping[str, int] | MeshShape) -> MeshShape:
        """`"data=2,fsdp=4"` (or a mapping of axis sizes, or a MeshShape) -> MeshShape; a bad spec is a ValueError
        of one line naming the item (`parse_mesh`, the grammar)."""
        return spec if isinstance(spec, MeshShape) else cls(**parse_mesh(spec))

    @property
    def devices(self) -> int:
        """How many devices the mesh spans: the product of its axis sizes."""
        return self.data * self.fsdp * self.tensor

    @property
    def batch_split(self) -> int:
        """How many ways the batch is split: the product of the batch axes' (data, fsdp) sizes."""
        return self.data * self.fsdp


def _mesh_items(spec: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    if not spec.strip():
        return items
    for part in spec.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(f"mesh {spec!r}: item {part.strip()!r} is not AXIS=SIZE, e.g. data=2,fsdp=4")
        # int() would also take "+2", "2_0" and non-ASCII digits; a mesh size is plain decimal digits.
        items.append((name, int(value) if value.isascii() and value.isdigit() else value))
    return items


def _mapping_items(spec: Any) -> list[tuple[Any, Any]]:
    if not isinstance(spec, Mapping):
        raise ValueError(f"mesh: expected 'AXIS=SIZE,...' text or a mapping of axis sizes, got {type(spec).__name__}")
    return list(spec.items())


def axis_size(mesh: Mesh, axis: str) -> int:
    """How many devices the mesh has along `axis` (1 when it has no such axis)."""
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes the batch is split over (data, fsdp), in that order."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """{axis: size} of a mesh."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def shards_state(mesh: Mesh) -> bool:
    """Whether the mesh shards parameters (an fsdp or tensor axis of size > 1), not only the batch."""
    return axis_size(mesh, FSDP) > 1 or axis_size(mesh, TENSOR) > 1


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


def make_mesh(shape: int | str | Mapping[str, int] | MeshShape | None = None, devices: list | None = None) -> Mesh:
    """The one mesh builder: `shape` is a device count, a 1-D mesh named `data` over the first `shape` devices
    (all of them when None, across processes), or axis sizes (a `MeshShape`, "data=2,fsdp=4" or {"data": 2,
    "fsdp": 4}; see `parse_mesh`), a mesh with axes (data, fsdp, tensor) (missing axes have size 1) over the first
    product-of-sizes devices. Devices come in process order, so each process holds one contiguous share of a
    batch; `devices` replaces `jax.devices()`."""
    devices = jax.devices() if devices is None else list(devices)
    if shape is None or isinstance(shape, int):
        n = len(devices) if shape is None else int(shape)
        if isinstance(shape, bool):
            raise ValueError(f"make_mesh: expected a device count or axis sizes, got {shape!r}")
        if not 1 <= n <= len(devices):
            raise ValueError(f"make_mesh: asked for {shape} devices, {len(devices)} available")
        # Auto (not the Explicit default): data parallelism leaves sharding propagation to XLA, so model code such
        # as embedding gathers never needs sharding annotations.
        return jax.make_mesh((n,), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices[:n])
    dims = dataclasses.astuple(MeshShape.parse(shape))  # (data, fsdp, tensor), in AXES' order
    needed = math.prod(dims)
    if needed > len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, dims))} needs {needed} devices, {len(devices)} available")
    # Auto axes: the rules fix the shardings of parameters and batches; XLA propagates the rest.
    return jax.make_mesh(dims, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:needed])


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over `data` (and `fsdp`, where the mesh has it), every other axis whole."""
    axes = batch_axes(mesh)
    return NamedSharding(mesh, P(axes[0] if len(axes) == 1 else axes))


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the batch axes' sizes."""
    return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that keeps a whole copy on every device of `mesh`."""
    return NamedSharding(mesh, P())


def check_batch_divisible(global_batch: int, mesh: Mesh) -> None:
    """Refuses a global batch the batch axes cannot split evenly."""
    n = batch_devices(mesh)
    if global_batch % n:
        axes = " x ".join(batch_axes(mesh))
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
