"""Placement: which device holds which part of every parameter, optimizer moment and batch, and putting arrays there.

The rules (`jaxnn.parallel.rules`) are `PartitionSpec`s over parameter paths and shapes; jit's in/out shardings
carry them and XLA's partitioner derives the collectives. Nothing here writes a collective by hand. On a mesh
that only splits the batch (and without rules) the train state is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxnn._src.pytree import is_prng_key, key_name, path_name
from jaxnn.parallel.mesh import (
    batch_sharding,
    check_batch_divisible,
    leading_size,
    mesh_sizes,
    replicated,
    shards_state,
)
from jaxnn.parallel.report import announce, layout_report, params_of
from jaxnn.parallel.rules import BUILT_IN, RulesLike, as_rules


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


def _path_keys(path: tuple) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules: RulesLike | None = None) -> P:
    """The PartitionSpec of one parameter under `rules` (default `BUILT_IN`; see `jaxnn.parallel.rules`)."""
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


def create_sharded_state(
    create: Callable[[], Any], mesh: Mesh, rules: RulesLike | None = None, *, show_report: bool = False
) -> Any:
    """Runs `create()` (e.g. `lambda: create_train_state(model, tx, key, in_shape)`) straight into its shardings:
    replicated, or the rules' shards on a mesh with fsdp or tensor axes (given rules apply on any mesh).

    The one way jaxnn creates a train state for a mesh (the loop, experiments and benchmarks alike): compiled
    with `out_shardings`, so every device builds only its part in place, and every process runs the same
    computation, so no process sends its copy to the others. When rules apply, the layout report
    (`jaxnn.parallel.report`) is logged first (and printed with `show_report`), and a rule that cannot apply
    raises before anything is compiled.
    """
    if not (shards_state(mesh) or rules is not None):
        return jax.jit(create, out_shardings=replicated(mesh))()
    abstract = jax.eval_shape(create)
    table = BUILT_IN if rules is None else as_rules(rules)
    announce(layout_report(params_of(abstract), mesh_sizes(mesh), table), show=show_report)
    return jax.jit(create, out_shardings=state_shardings(abstract, mesh, table))()


def place_state(state: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """`state` (e.g. built on one device) on `mesh`: replicated, or sharded by the rules when the mesh shards the
    state or rules are given."""
    if shards_state(mesh) or rules is not None:
        return jax.device_put(state, state_shardings(state, mesh, rules))
    return replicate(state, mesh)


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes of `tree`'s arrays each device holds (from the arrays' addressable shards), by device."""
    held: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", []):
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held
