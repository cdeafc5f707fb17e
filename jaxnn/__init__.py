"""jaxnn: pure-functional neural-network layers and compiled training steps for JAX.

`jaxnn.fit(model, data, ...)` is the training loop (`jaxnn.loop`), `jaxnn.evaluate` and `jaxnn.predict` run a
trained model over a data set (`jaxnn.evaluation`); layers are in `jaxnn.layers`, models in `jaxnn.models`,
callbacks in `jaxnn.callbacks`. Every public submodule is reachable as an attribute (`jaxnn.layers`,
`jaxnn.train`, ...) and is imported on first use, so that `import jaxnn.cli` stays light and leaves jax's device
set-up to the command line.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

# Names re-exported from the module that defines them.
_NAMES = {
    "fit": "jaxnn.loop",
    "FitResult": "jaxnn.loop",
    "FitInterrupted": "jaxnn.loop",
    "fresh_run_dir": "jaxnn.loop",
    "FitConfig": "jaxnn.config",
    "evaluate": "jaxnn.evaluation",
    "predict": "jaxnn.evaluation",
}

SUBMODULES = (
    "activation_sharding",
    "augment",
    "callbacks",
    "checkpoint",
    "cli",
    "compile_cache",
    "config",
    "data",
    "decoding_export",
    "evaluation",
    "export",
    "finetune",
    "interop",
    "generate",
    "kernels",
    "layers",
    "loop",
    "mesh",
    "metrics",
    "models",
    "optional",
    "ownership",
    "parallel",
    "plots",
    "precision",
    "profile",
    "pytree",
    "rundir",
    "shard_report",
    "shard_rules",
    "sharding",
    "storage",
    "timing",
    "trace",
    "train",
)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in SUBMODULES:
        return importlib.import_module(f"jaxnn.{name}")
    raise AttributeError(f"module 'jaxnn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES, *SUBMODULES])


__all__ = ["FitConfig", "FitInterrupted", "FitResult", "evaluate", "fit", "fresh_run_dir", "predict"]
