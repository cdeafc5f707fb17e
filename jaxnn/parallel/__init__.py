"""Parallel training's vocabulary: meshes, where arrays go on them, sharding rules, the layout report, and the
activation constraints. One device, eight simulated CPU devices, or many processes run the same code.

- `mesh`: simulated CPU devices, `make_mesh` (the one mesh builder: a device count or axis sizes such as
  "data=2,fsdp=4"), the batch's axes, and `initialize_distributed` for multi-process runs;
- `placement`: `create_sharded_state` and `place_state` (the one placement path), `shard_batch`, the shardings
  of a train state under a rule table;
- `rules`: `ShardingRules`, ordered parameter-path patterns -> partition specs, and `BUILT_IN` for jaxnn's layers;
- `report`: the layout report (what each mesh axis splits) and `ShardingWarning`;
- `activations`: sharding constraints inside the built-in blocks, by logical axis.

The data-parallel step (`data_parallel_train_step` in its jit, shard_map and pmap forms) is training, and lives in
`jaxnn.train.data_parallel`, above the layers; this package sits below them and imports only `jaxnn._src`,
`jaxnn.errors` and its own modules. The step's old names here (`data_parallel_train_step`, `per_device_step_fn`,
`DataParallelStep`, `FORMS`, `bn_axis_name`, and the module `forms`) still resolve as attributes, with a
DeprecationWarning naming the new home, until 0.2.

Every name below is reachable as `jaxnn.parallel.<name>`; the submodules are imported on first use, so that the
layers can import `activations` without loading the others.
"""

import importlib
import warnings
from typing import Any

from jaxnn._src.lazy import lazy_exports

_HOMES = {
    "mesh": (
        "BATCH_AXES",
        "DATA_AXIS",
        "ENV_COORDINATOR",
        "ENV_NUM_PROCESSES",
        "ENV_PROCESS_ID",
        "axis_size",
        "batch_axes",
        "batch_devices",
        "batch_sharding",
        "check_batch_divisible",
        "configure_cpu_devices",
        "initialize_distributed",
        "leading_size",
        "make_mesh",
        "mesh_sizes",
        "parse_mesh",
        "process_slice",
        "replicated",
        "shards_state",
    ),
    "placement": (
        "bytes_per_device",
        "create_sharded_state",
        "param_spec",
        "param_specs",
        "place_state",
        "replicate",
        "shard_batch",
        "state_shardings",
    ),
    "rules": (
        "AXES",
        "BUILT_IN",
        "DATA",
        "FSDP",
        "TENSOR",
        "Rule",
        "RulesLike",
        "ShardingRules",
        "as_rules",
        "load_rules",
        "rule",
    ),
    "report": ("AxisReport", "LayoutReport", "ShardingWarning", "announce", "layout_report", "params_of"),
    "activations": ("BATCH", "HIDDEN", "LOGICAL_AXES", "constrain"),
}
_NAMES = {name: module for module, names in _HOMES.items() for name in names}
SUBMODULES = tuple(_HOMES)


_lazy_getattr, __dir__ = lazy_exports("jaxnn.parallel", _NAMES, SUBMODULES)

# Names that moved to `jaxnn.train.data_parallel` with the data-parallel step: named by string (this package
# imports nothing above it), resolved on attribute access only with a DeprecationWarning, left out of `dir()` and
# `__all__`; removed in 0.2.
_MOVED = {
    "forms": "jaxnn.train.data_parallel",  # the module itself
    **{
        name: f"jaxnn.train.data_parallel.{name}"
        for name in ("DataParallelStep", "FORMS", "bn_axis_name", "data_parallel_train_step", "per_device_step_fn")
    },
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        return _lazy_getattr(name)
    new = _MOVED[name]
    warnings.warn(
        f"jaxnn.parallel.{name} is deprecated and will be removed in 0.2; use {new}", DeprecationWarning, stacklevel=2
    )
    if name == "forms":
        return importlib.import_module(new)
    module, _, attr = new.rpartition(".")
    return getattr(importlib.import_module(module), attr)


__all__ = sorted(_NAMES)
