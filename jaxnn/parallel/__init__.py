"""Parallel training: meshes, where arrays go on them, sharding rules, the layout report, and the data-parallel
step in its forms. One device, eight simulated CPU devices, or many processes run the same code.

- `mesh`: simulated CPU devices, `make_mesh` (the one mesh builder: a device count or axis sizes such as
  "data=2,fsdp=4"), the batch's axes, and `initialize_distributed` for multi-process runs;
- `placement`: `create_sharded_state` and `place_state` (the one placement path), `shard_batch`, the shardings
  of a train state under a rule table;
- `rules`: `ShardingRules`, ordered parameter-path patterns -> partition specs, and `BUILT_IN` for jaxnn's layers;
- `report`: the layout report (what each mesh axis splits) and `ShardingWarning`;
- `activations`: sharding constraints inside the built-in blocks, by logical axis;
- `forms`: `data_parallel_train_step` in its jit, shard_map and pmap forms.

Every name below is reachable as `jaxnn.parallel.<name>`; the submodules are imported on first use, so that the
layers can import `activations` without loading the training step.
"""

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
    "forms": ("FORMS", "DataParallelStep", "bn_axis_name", "data_parallel_train_step", "per_device_step_fn"),
}
_NAMES = {name: module for module, names in _HOMES.items() for name in names}
SUBMODULES = tuple(_HOMES)


__getattr__, __dir__ = lazy_exports("jaxnn.parallel", _NAMES, SUBMODULES)

__all__ = sorted(_NAMES)
