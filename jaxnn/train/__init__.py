"""Compiled training: `TrainState`, the pure train step, losses, optimizers, the eval step, K steps per call with
`lax.scan`, and data-parallel training over a mesh.

- `state`: `TrainState`, `create_train_state`, and the `Batch`, `Metrics`, `LossFn`, `AugmentFn`, `StepFn` types;
- `losses`: `classification_loss`, `masked_classification_loss`, `language_model_loss`, `lm_loss`,
  `integer_label_cross_entropy`;
- `optim`: `make_optimizer`, `make_schedule` and its `SCHEDULES`, `weight_decay_mask`, `check_optimizer`;
- `step`: `train_step_fn` (the one pure step), `make_train_step`, `make_multi_step`, `make_eval_step`,
  `make_predict`, `forward_batch`, `micro_batches`;
- `data_parallel`: `data_parallel_train_step` in its jit, shard_map and pmap forms (`FORMS`; `fit` runs
  `FIT_FORMS`), `DataParallelStep`, `per_device_step_fn`, `bn_axis_name`.

A step is a pure function `(state, batch) -> (state, metrics)`; `batch` is a dict with inputs `"x"` and targets
`"y"`. Randomness for a step is `fold_in(state.key, state.step)` (big_vision's habit), so a resumed run draws the
same dropout masks as an uninterrupted one.

Every name below is reachable as `jaxnn.train.<name>`. The data-parallel names load on first use, so that a
single-device program does not import the mesh and placement machinery.
"""

from jaxnn._src.lazy import lazy_exports
from jaxnn.train.losses import (
    classification_loss,
    integer_label_cross_entropy,
    language_model_loss,
    lm_loss,
    masked_classification_loss,
)
from jaxnn.train.optim import SCHEDULES, check_optimizer, make_optimizer, make_schedule, weight_decay_mask
from jaxnn.train.state import AugmentFn, Batch, LossFn, Metrics, StepFn, TrainState, create_train_state
from jaxnn.train.step import (
    PACKED_SIDE_INPUTS,
    forward_batch,
    make_eval_step,
    make_multi_step,
    make_predict,
    make_train_step,
    micro_batches,
    train_step_fn,
)

_LAZY = dict.fromkeys(
    ("FIT_FORMS", "FORMS", "DataParallelStep", "bn_axis_name", "data_parallel_train_step", "per_device_step_fn"),
    "jaxnn.train.data_parallel",
)
SUBMODULES = ("data_parallel", "losses", "optim", "preference", "state", "step")

__getattr__, __dir__ = lazy_exports("jaxnn.train", _LAZY, SUBMODULES)

__all__ = [
    "AugmentFn",
    "Batch",
    "DataParallelStep",
    "FIT_FORMS",
    "FORMS",
    "LossFn",
    "Metrics",
    "PACKED_SIDE_INPUTS",
    "SCHEDULES",
    "StepFn",
    "TrainState",
    "bn_axis_name",
    "check_optimizer",
    "classification_loss",
    "create_train_state",
    "data_parallel_train_step",
    "forward_batch",
    "integer_label_cross_entropy",
    "language_model_loss",
    "lm_loss",
    "make_eval_step",
    "make_multi_step",
    "make_optimizer",
    "make_predict",
    "make_schedule",
    "make_train_step",
    "masked_classification_loss",
    "micro_batches",
    "per_device_step_fn",
    "train_step_fn",
    "weight_decay_mask",
]
