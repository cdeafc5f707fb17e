"""Sharding rules: which device holds which part of every parameter, optimizer moment and batch.

A mesh has up to three named axes, always in this order:
- `data`: the batch is split over it; parameters are replicated along it (data parallelism).
- `fsdp`: the batch is split over it too, and so is every parameter and optimizer moment large enough, along one
  dimension (fully sharded data parallelism, ZeRO-3): each device stores 1/fsdp of the state, and XLA gathers a
  layer's parameters when the step uses them and reduce-scatters their gradients.
- `tensor`: tensor parallelism, where a rule table (`jaxnn.shard_rules`) says which parameter dimensions it
  splits; `BUILT_IN` gives Megatron's layout for jaxnn's attention and MLP layers, and any model can have its own.

The rules are `PartitionSpec`s over parameter paths and shapes; jit's in/out shardings carry them and XLA's
partitioner derives the collectives. Nothing here writes a collective by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxnn.pytree import key_name, path_name
from jaxnn.shard_report import announce, layout_report, params_of
from jaxnn.shard_rules import AXES, BUILT_IN, DATA, FSDP, TENSOR, RulesLike, as_rules

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


def make_sharded_mesh(spec: str | Mapping[str, int], devices: list | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor) of the sizes `spec` gives (missing axes have size 1), over the first
    product-of-sizes devices (all processes' devices, in process order)."""
    sizes = parse_mesh(spec)
    shape = tuple(sizes.get(axis, 1) for axis in AXES)
    devices = jax.devices() if devices is None else devices
    needed = math.prod(shape)
    if needed > len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, shape))} needs {needed} devices, {len(devices)} available")
    # Auto axes: the rules below fix the shardings of parameters and batches; XLA propagates the rest.
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:needed])


def axis_size(mesh: Mesh, axis: str) -> int:
    """How many devices the mesh has along `axis` (1 when it has no such axis)."""
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes the batch is split over (data, fsdp), in that order."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def shards_state(mesh: Mesh) -> bool:
    """Whether the mesh shards parameters (an fsdp or tensor axis of size > 1), not only the batch."""
    return axis_size(mesh, FSDP) > 1 or axis_size(mesh, TENSOR) > 1


def _path_keys(path: tuple) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """{axis: size} of a mesh."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules: RulesLike | None = None) -> P:
    """The PartitionSpec of one parameter under `rules` (default `BUILT_IN`; see `jaxnn.shard_rules`)."""
    table = BUILT_IN if rules is None else as_rules(rules)
    return table.spec(path_name(path), shape, mesh_sizes(mesh))


def param_specs(params: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """`param_spec` for every leaf of a parameter tree (arrays or `jax.ShapeDtypeStruct`s)."""
    table = BUILT_IN if rules is None else as_rules(rules)
    sizes = mesh_sizes(mesh)
    return jax.tree_util.tree_map_with_path(lambda p, x: table.spec(path_name(p), tuple(x.shape), sizes), params)


def state_shardings(state: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """NamedShardings for a whole `TrainState` (or any tree holding the params): the params by the rules, every
    optimizer leaf whose path ends with a parameter's path and has its shape (Adam's moments) like that parameter,
    everything else (step, key, BatchNorm statistics, loss scale) replicated."""
    params = getattr(state, "params", None)
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], P]] = {}
    if params is not None:
        specs = param_specs(params, mesh, rules)
        for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs)):
            by_path[_path_keys(path)] = (tuple(leaf.shape), spec)

    def sharding(path: tuple, leaf: Any) -> NamedSharding:
        keys, shape = _path_keys(path), tuple(np.shape(leaf))
        for start in range(len(keys)):
            match = by_path.get(keys[start:])
            if match is not None and match[0] == shape:
                return NamedSharding(mesh, match[1])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, state)


def create_state(create: Callable[[], Any], mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """Runs `create()` straight into the rules' shardings: each device builds only its shards. The layout report
    (`jaxnn.shard_report`) is logged first, and a rule that cannot apply raises before anything is compiled."""
    abstract = jax.eval_shape(create)
    table = BUILT_IN if rules is None else as_rules(rules)
    announce(layout_report(params_of(abstract), mesh_sizes(mesh), table))
    return jax.jit(create, out_shardings=state_shardings(abstract, mesh, table))()


def place_state(state: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """Moves an existing state onto the rules' shardings (e.g. a state built on one device)."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes of `tree`'s arrays each device holds (from the arrays' addressable shards), by device."""
    held: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", []):
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held
