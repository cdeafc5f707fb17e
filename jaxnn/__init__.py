"""jaxnn: pure-functional neural-network layers and compiled training steps for JAX.

`jaxnn.fit(model, data, ...)` is the training loop (`jaxnn.loop`), `jaxnn.evaluate` and `jaxnn.predict` run a
trained model over a data set (`jaxnn.evaluation`); layers are in `jaxnn.layers`, models in `jaxnn.models`,
callbacks in `jaxnn.callbacks`, meshes and sharding rules in `jaxnn.parallel`, the steps in `jaxnn.train`. Every
public module (`SUBMODULES`) is reachable as an attribute (`jaxnn.layers`, `jaxnn.train`, ...) and is imported on
first use, so that `import jaxnn.cli` stays light and leaves jax's device set-up to the command line. `jaxnn._src`
is internal: what it holds may change without notice.

Importing jaxnn changes nothing process-wide (environment, malloc, log levels, jax's configuration). A program that
wants XLA's CPU scratch memory kept between steps calls `jaxnn.keep_host_memory()` first, or sets `JAXNN_MALLOC=1`
(docs/performance.md, "Host memory between steps"); the `jaxnn` command does so itself.
"""

from jaxnn._src import malloc as _malloc
from jaxnn._src.lazy import lazy_exports

# Only where the environment asks for it (JAXNN_MALLOC=1 or one-arena): the program opted in before it started.
_malloc.apply_requested()

__version__ = "0.1.0"

# Names re-exported from the module that defines them.
_NAMES = {
    "fit": "jaxnn.loop",
    "FitResult": "jaxnn.loop",
    "FitInterrupted": "jaxnn.loop",
    "fresh_run_dir": "jaxnn.loop",
    "lr_find": "jaxnn.loop.lr_range",
    "FitConfig": "jaxnn.config",
    "evaluate": "jaxnn.evaluation",
    "predict": "jaxnn.evaluation",
    "save_model": "jaxnn.saving",
    "load_model": "jaxnn.saving",
    "keep_host_memory": "jaxnn._src.malloc",
}

# The public modules and packages (the API; docs/index.md, "The package's layout"). `jaxnn._src` holds internals.
SUBMODULES = (
    "augment",
    "callbacks",
    "checkpoint",
    "cli",
    "config",
    "data",
    "decoding",
    "decoding_export",
    "errors",
    "evaluation",
    "export",
    "finetune",
    "fp8",
    "generate",
    "interop",
    "kernels",
    "layers",
    "loop",
    "lora",
    "metric_services",
    "metrics",
    "models",
    "parallel",
    "precision",
    "profile",
    "quantized",
    "saving",
    "scores",
    "serve",
    "train",
)


__getattr__, __dir__ = lazy_exports("jaxnn", _NAMES, SUBMODULES)

__all__ = [
    "FitConfig",
    "FitInterrupted",
    "FitResult",
    "evaluate",
    "fit",
    "fresh_run_dir",
    "keep_host_memory",
    "load_model",
    "lr_find",
    "predict",
    "save_model",
]
