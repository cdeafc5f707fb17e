"""Every error and warning a jaxnn user may catch, in one place (each is also importable from the module that
raises it, under the same name).

Bad input is a `ValueError`: the message is one line that names the culprit (a field, a file, a layer's path), and
nothing was written. A failure while working (a non-finite loss, a full disk) is not: `NonFiniteError` is a
`RuntimeError`, `StorageError` an `OSError`. The `jaxnn` command maps the first to exit status 2 and the second to
1 (`jaxnn.cli.main`). This module imports nothing from jaxnn, so every other module can import it.
"""

from __future__ import annotations

__all__ = [
    "ChatTemplateError",
    "CheckpointError",
    "CompileCacheError",
    "ConfigError",
    "DataError",
    "LayerError",
    "LayerTypeError",
    "ModelSaveError",
    "NonFiniteError",
    "ProfileError",
    "ProjectionError",
    "RunDirError",
    "ServerBusyError",
    "ShardingWarning",
    "SkippedStepsError",
    "StorageError",
    "TensorMismatchError",
    "TokenizerError",
    "PrecisionWarning",
    "UnusedDevicesWarning",
]

# ----------------------------------------------------------------------------------------------------- bad input


class ConfigError(ValueError):
    """A configuration that cannot run (`FitConfig`, `jaxnn train`'s flags); the message names the field."""


class CompileCacheError(ValueError):
    """A compile-cache setting that cannot be used; the message names it."""


class RunDirError(ValueError):
    """A run (or output) directory that cannot be used as asked: held by another run, not a directory, not writable."""


class DataError(ValueError):
    """A data directory or file that does not hold what its format promises; the message names the file."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incompatible with this run, or no readable one left."""


class ModelSaveError(ValueError):
    """A model (or folder) that cannot be saved or loaded as asked; one line naming the part at fault."""


class TensorMismatchError(ValueError):
    """A checkpoint that does not fit the jaxnn model: a missing or unexpected tensor, or a wrong shape."""


class TokenizerError(ValueError):
    """A tokenizer that is missing, unreadable or not the one a run was trained with; one line naming the file."""


class ChatTemplateError(ValueError):
    """Chat messages for a model without a chat template, or messages its template refuses (`raise_exception`)."""


class ProfileError(ValueError):
    """Input `profile_layers` cannot profile (not a Layer, a bad shape or batch size); nothing was measured."""


class ProjectionError(ValueError):
    """An accelerator description that cannot be used (a missing dtype, a non-positive peak)."""


class LayerError(ValueError):
    """A bad input or parameter, raised in one line naming the layer's path within the model (`path`, outermost
    first, grows as the error passes up through combinators)."""

    def __init__(self, layer_name: str, detail: str):
        super().__init__(detail)
        self.path = [layer_name]
        self.detail = detail

    def __str__(self) -> str:
        return f"{'/'.join(self.path)}: {self.detail}"


class LayerTypeError(LayerError, TypeError):
    """A `LayerError` for an input of the wrong dtype."""


# ------------------------------------------------------------------------------------------- failures while working


class NonFiniteError(RuntimeError):
    """Training produced a NaN or Inf loss (or parameters); the message names the step."""


class SkippedStepsError(NonFiniteError):
    """Under fp16 loss scaling, too many recent steps were skipped for non-finite gradients to call it training."""


class ServerBusyError(RuntimeError):
    """`jaxnn.serve.Engine` has as many requests waiting as its queue holds (or is shutting down); retry later."""


class StorageError(OSError):
    """Writing to the run directory failed (disk full, permissions, ...); the message says where and why."""


# -------------------------------------------------------------------------------------------------------- warnings


class ShardingWarning(UserWarning):
    """A layout that leaves a mesh axis idle, or a rule that matches no parameter."""


class UnusedDevicesWarning(UserWarning):
    """fit trains on fewer devices than the process has (said once per process)."""


class PrecisionWarning(UserWarning):
    """The run's precision does not pay on this backend (bf16 on a CPU without bf16 instructions, fp8 on any
    CPU): it runs slower than fp32 there."""
