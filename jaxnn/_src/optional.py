"""Optional dependencies: each belongs to a pip extra, and a missing one is named with the command that adds it.

jaxnn's core needs jax, optax, orbax-checkpoint, numpy and safetensors; what only some users need is an extra:
`pip install 'jaxnn[plots]'` (matplotlib), `[progress]` (tqdm), `[tensorboard]` (tensorboardX), `[grain]` (Grain's
worker processes), `[data]` (scikit-learn, for the bundled digits), `[augment]` (dm-pix, for augmentation in the
step), `[quant]` (Qwix, for LoRA over an int8 or nf4 base), `[wandb]` and `[mlflow]` (the metric writers of the
tracking services), or `[all]`; `[docs]` (pdoc) builds the documentation
(`make docs`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

log = logging.getLogger(__name__)

# module -> the extra that installs it
EXTRAS = {
    "matplotlib": "plots",
    "tqdm": "progress",
    "tensorboardX": "tensorboard",
    "grain": "grain",
    "sklearn": "data",
    "pdoc": "docs",
    "dm_pix": "augment",
    "torch": "interop",
    "torchvision": "interop",
    "transformers": "interop",
    "tokenizers": "interop",
    "qwix": "quant",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
_warned: set[str] = set()


def hint(module: str) -> str:
    """`pip install 'jaxnn[extra]'` for the extra that brings `module`."""
    return f"pip install 'jaxnn[{EXTRAS[module.split('.')[0]]}]'"


def require(module: str, what: str) -> ModuleType:
    """Imports `module`, or raises ImportError in one line: what needs it and the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs {module.split('.')[0]}: {hint(module)}") from None


def installed(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def importable(module: str) -> bool:
    """Whether `module` can be imported, without importing it; False too where `sys.modules` blocks it (None)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module set to None in sys.modules
        return False


def available(module: str, what: str) -> bool:
    """Whether `module` imports; if not, says once (a warning) what is skipped and how to get it."""
    try:
        importlib.import_module(module)
    except ImportError:
        if module not in _warned:
            _warned.add(module)
            log.warning("%s skipped: %s is not installed (%s)", what, module.split(".")[0], hint(module))
        return False
    return True
