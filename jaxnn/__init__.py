"""jaxnn: pure-functional neural-network layers and compiled training steps for JAX.

`jaxnn.fit(model, data, ...)` is the training loop (`jaxnn.loop`); layers are in `jaxnn.layers`, models in
`jaxnn.models`, callbacks in `jaxnn.callbacks`.
"""

__version__ = "0.1.0"

_LAZY = {"fit": "jaxnn.loop", "FitResult": "jaxnn.loop", "FitConfig": "jaxnn.config"}


def __getattr__(name: str):
    # Lazy, so that `import jaxnn.cli` stays light and leaves jax's device set-up to the command line.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxnn' has no attribute {name!r}")


__all__ = ["FitConfig", "FitResult", "fit"]
