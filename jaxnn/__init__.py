"""jaxnn: pure-functional neural-network layers and compiled training steps for JAX.

`jaxnn.fit(model, data, ...)` is the training loop (`jaxnn.loop`), `jaxnn.evaluate` and `jaxnn.predict` run a
trained model over a data set (`jaxnn.evaluation`); layers are in `jaxnn.layers`, models in
`jaxnn.models`, callbacks in `jaxnn.callbacks`.
"""

__version__ = "0.1.0"

_LAZY = {
    "fit": "jaxnn.loop",
    "FitResult": "jaxnn.loop",
    "FitInterrupted": "jaxnn.loop",
    "fresh_run_dir": "jaxnn.loop",
    "FitConfig": "jaxnn.config",
    "evaluate": "jaxnn.evaluation",
    "predict": "jaxnn.evaluation",
}


def __getattr__(name: str):
    # Lazy, so that `import jaxnn.cli` stays light and leaves jax's device set-up to the command line.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxnn' has no attribute {name!r}")


__all__ = ["FitConfig", "FitInterrupted", "FitResult", "evaluate", "fit", "fresh_run_dir", "predict"]
