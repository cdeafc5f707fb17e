"""Device meshes and shardings for data-parallel training.

The default form is `jax.jit` with `NamedSharding`: the batch is split over the mesh's `data` axis and the
train state is replicated; XLA inserts the gradient all-reduce itself.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh named `data` over the first `num_devices` devices (all of them by default, across processes)."""
    available = jax.device_count()
    n = available if num_devices is None else num_devices
    if not 1 <= n <= available:
        raise ValueError(f"make_mesh: asked for {num_devices} devices, {available} available")
    return jax.make_mesh((n,), (DATA_AXIS,), devices=jax.devices()[:n])


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
