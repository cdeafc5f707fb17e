"""`jaxnn.fit(model, data, ...)`: the keyword API of the training loop.

    result = jaxnn.fit(model, (x, y), steps=500, batch_size=64, eval_data=(x_test, y_test), run_dir="runs/a")
    result.state, result.history, result.summary

Setup refuses bad input (config, data, model/loss on a batch, run directory) before anything is written; the
loop itself is `run_fit` (jaxnn/loop/_run.py), its checks jaxnn/loop/_setup.py, its bookkeeping
jaxnn/loop/_bookkeeping.py.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import optax
from jax.sharding import Mesh

from jaxnn.augment import Augment, as_augment
from jaxnn.callbacks import Callback
from jaxnn.config import ConfigError, FitConfig
from jaxnn.data.pipeline import PipelineConfig
from jaxnn.layers.core import Layer
from jaxnn.loop._keywords import keras_data
from jaxnn.loop._preference import preference_start
from jaxnn.loop._run import FitInputs, FitInterrupted, FitResult, TrainData, run_fit
from jaxnn.loop.rundir import fresh_run_dir
from jaxnn.lora import LoRA, as_lora
from jaxnn.parallel.mesh import MeshShape
from jaxnn.parallel.rules import RulesLike
from jaxnn.train import LossFn, masked_classification_loss


def fit(
    model: Layer,
    data: TrainData,
    *,
    loss: LossFn = masked_classification_loss,
    optimizer: optax.GradientTransformation | None = None,
    eval_data: TrainData | None = None,
    eval_metrics: Sequence[Any] | None = None,
    callbacks: Iterable[Callback] = (),
    mesh: Mesh | MeshShape | str | None = None,
    sharding_rules: RulesLike | None = None,
    pipeline: PipelineConfig | None = None,
    augment: Augment | str | None = None,
    config: dict | None = None,
    params: Any = None,
    model_state: Any = None,
    init_from: str | os.PathLike[str] | None = None,
    lora: LoRA | str | None = None,
    objective: str | None = None,
    beta: float = 0.1,
    gamma: float = 0.5,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int | None = 64,
    accumulate: int = 1,
    precision: str = "fp32",
    remat: str | None = None,
    clip_norm: float | None = 1.0,
    ema: float | None = None,
    seed: int = 0,
    eval_every: int = 0,
    log_every: int = 50,
    ckpt_every: int = 0,
    keep: int = 3,
    keep_best: str | None = None,
    keep_best_mode: str = "auto",
    run_dir: str | None = None,
    ckpt_dir: str | None = None,
    resume: bool | str | os.PathLike[str] = False,
    check_optimizer: bool = True,
    overwrite: bool = False,
    metrics: tuple[str, ...] = (),
    progress: bool = True,
    plots: bool = True,
    devices: int = 1,
    form: str = "jit",
    prefetch: int = 2,
    guard_nonfinite: bool = True,
    async_checkpoints: bool = True,
    name: str = "fit",
    profile_dir: str | None = None,
    compile_cache: str = "auto",
    check_data: str = "arrays",
    validation_split: float | None = None,
    class_weight: dict | None = None,
    sample_weight: Any = None,
    **unknown: Any,
) -> FitResult:
    """Trains `model` on `data` and returns `FitResult(state, history, summary)`.

    model: any `jaxnn.layers.Layer`; its input is `batch["x"]`.
    data: `(x, y)` arrays, a dict of arrays, a jaxnn data set, or an iterable of batch dicts (see
      `jaxnn.data.sources`); `eval_data` likewise. Evaluation is exact for any loss (`jaxnn.evaluation`).
    eval_metrics: metrics computed over the whole of `eval_data` at each evaluation, besides the loss's own: names
      ("f1", "precision", "recall", "roc_auc", "top5_accuracy", "perplexity", "mae", ...) or `jaxnn.scores.Score`s;
      `EarlyStopping` and `keep_best` can watch them.
    loss: `(logits, batch) -> (loss, metrics)`, a mean over the batch's examples; a `count` metric, if
      returned, weights each example in evaluation.
    optimizer: any optax `GradientTransformation` (default: `make_optimizer(1e-3, total_steps=steps,
      clip_norm=clip_norm)`: AdamW, cosine decay to 0 at `steps`, gradients clipped to global norm 1.0); one that
      takes `value` (`optax.contrib.reduce_on_plateau`) gets the step's training loss.
    callbacks: `jaxnn.callbacks.Callback` instances; a `NonFiniteGuard` is added unless `guard_nonfinite=False`.
    mesh: a `jax.sharding.Mesh` with a `data` axis and optionally `fsdp` and `tensor` axes, or its sizes: a
      `jaxnn.parallel.mesh.MeshShape` or its text ("data=2,fsdp=4", see `jaxnn.parallel.make_mesh`) (default:
      `devices` local devices on a `data` axis, or all devices of all processes in a multi-process run).
    sharding_rules: where each parameter (and its optimizer moments and checkpointed arrays) goes on the mesh:
      (pattern, spec) pairs, a {pattern: spec} mapping, a `jaxnn.parallel.rules.ShardingRules` or a JSON file's
      path (see `jaxnn.parallel.rules`; default: the built-in models' table).
    pipeline: a `PipelineConfig` for jaxnn data sets (workers, host-side augmentation).
    augment: a `jaxnn.augment.Augment` (or its text, "crop,flip,mixup"): random augmentation inside the step, on
      the device, keyed by (seed, step, example index); evaluation sees the data unaugmented. Mixup and cutmix add
      `y_soft`, which the classification losses train against.
    config: JSON-able facts about the run (model and optimizer settings) saved in config.json and the
      checkpoints; a resume with different facts is refused, naming them.
    params, model_state: start from these (e.g. `jaxnn.finetune.load_into` of a trained model's) instead of the
      model's initialisation; they must have the shapes the model's init gives, and their digest joins the record.
    init_from: a run directory or checkpoint of the same model and optimizer: this new run starts from its
      parameters, model state and optimizer state (at step 0 of its own, with its own seed and data order).
    lora: train low-rank adapters instead of the model's weights: a `jaxnn.lora.LoRA` or its text
      ("r=8,alpha=16,targets=*attention*.w"). Adapters join the starting params (from `params`, `init_from`'s
      parameters, or the initialisation); the rest is frozen, with no optimizer state; `optimizer` then updates
      the adapters alone. The final state holds both (`jaxnn.lora.merge` folds them, `save_adapters` keeps them).
    objective: "dpo" or "simpo": preference tuning of a language model on `{"prompt", "chosen", "rejected"}` pairs
      (`jaxnn.data.preference.load_preference_records`); `loss` is then the objective's (`jaxnn.train.preference`):
      DPO with `beta` against a reference (under `lora`, the base with the adapters off; otherwise a frozen copy of
      `params` or `init_from`'s), or SimPO with `beta` and the margin `gamma`, reference-free. The metrics add the
      reward margin, the preference accuracy and the chosen and rejected responses' log-probabilities.
    resume: True continues the run in `run_dir` from its newest checkpoint; a `jaxnn.save_model` folder saved
      from a train state (a FitResult) continues that state: its step, optimizer state and key, with the data
      order of `seed` from its step on, so the same data and settings give the run it would have been. With a
      `run_dir`, a checkpoint there newer than the folder wins (the continued run was itself stopped).
    check_optimizer: a resume (of a run directory or a saved model) whose optimizer differs from the recorded one
      (its transformations, their settings such as the learning rate, a schedule's length), or that changes
      `steps` under the default optimizer, whose schedule decays to 0 at `steps`, is refused naming the difference;
      False continues anyway, with this call's optimizer on the saved optimizer state.
    validation_split: hold out the last fraction of `data`'s arrays (before any shuffling) as `eval_data`, as
      Keras does; with `eval_data` it is refused.
    class_weight, sample_weight: weight each training example's loss by `class_weight[y]` (a dict {class: weight})
      times its `sample_weight` (one number per example of `data`'s arrays): they become `batch["mask"]`, which the
      classification losses read as a weighted mean (sum of w * loss over sum of w; Keras divides by the batch
      size instead) and your own loss reads as it likes. The evaluation is not weighted.
    steps, epochs, batch_size, ...: the fields of `jaxnn.config.FitConfig`, which documents and validates them;
      give `steps` or `epochs`, not both. Any other keyword is refused with the list of known ones.

    The keywords become one `FitConfig` (the settings) and one `FitInputs` (the objects), and `run_fit` trains:
    `run_fit(model, data, cfg, FitInputs(...))` is the same call for code that holds a FitConfig already.

    Ctrl-C (SIGINT) saves a checkpoint and summary.json, then raises `FitInterrupted` (a KeyboardInterrupt);
    SIGTERM does the same and returns normally.
    """
    # Over 80 lines only through its signature and docstring, and kept whole: every FitConfig field is a keyword so
    # that help() and editors list them. The body is ten lines: one FitConfig, validated once here, and the
    # objects (their text converted to typed values), handed to the loop (jaxnn.loop._run) whole.
    data, eval_data, facts = keras_data(data, eval_data, validation_split, class_weight, sample_weight)
    config = {**(config or {}), **facts} if facts else config
    values = dict(locals())
    values.update(mesh=_as_mesh(mesh), augment=_as_augment(augment), lora=_as_lora(lora))  # text read once, here
    values["resume_from"] = None if isinstance(resume, bool) else _saved_model_to_resume(resume)
    inputs = FitInputs(**{name: values[name] for name in FitInputs._fields if name in values})
    if objective is not None:
        model, inputs = preference_start(model, data, objective, beta, gamma, inputs)
    return run_fit(model, data, _fit_config(values, unknown), inputs)


def _fit_config(values: dict, unknown: dict) -> FitConfig:
    """The FitConfig of fit's keywords (FitConfig validates them); `steps` and `epochs` exclude each other."""
    settings = {f.name: values[f.name] for f in dataclasses.fields(FitConfig)}
    if settings["steps"] is not None and settings["epochs"] is not None:
        raise ConfigError(f"fit: give steps or epochs, not both (got steps {settings['steps']} and epochs)")
    if not isinstance(settings["resume"], bool):  # a saved model: the run dir's checkpoints, if any, are newer
        settings["resume"] = settings["run_dir"] is not None
    if settings["steps"] is None:
        del settings["steps"]  # FitConfig's default, or what `epochs` makes of it
    return FitConfig.from_settings({**settings, **unknown})


def _as_mesh(mesh: Any) -> Mesh | MeshShape | None:
    """fit's `mesh`: a Mesh or None as given, its sizes (text, a mapping) as a MeshShape (a ValueError of one line
    naming the item otherwise)."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if not isinstance(mesh, (str, Mapping, MeshShape)):
        raise ConfigError(
            f"fit: mesh must be a jax.sharding.Mesh, a jaxnn.parallel.mesh.MeshShape or its text, got "
            f"{type(mesh).__name__}"
        )
    try:
        return MeshShape.parse(mesh)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _as_augment(augment: Any) -> Augment | None:
    try:
        return None if augment is None else as_augment(augment)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: {err}") from None


def _as_lora(lora: Any) -> LoRA | None:
    try:
        return None if lora is None else as_lora(lora)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: {err}") from None


def _saved_model_to_resume(path: Any) -> str:
    from jaxnn.saving import TRAINING_FILE, is_saved_model

    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"fit: resume must be True, False or a jaxnn.save_model folder, got {path!r}")
    if not is_saved_model(path):
        raise ConfigError(
            f"fit: resume={os.fspath(path)!r} is not a jaxnn.save_model folder; to continue a run directory, pass "
            "run_dir= and resume=True"
        )
    if not (pathlib.Path(path) / TRAINING_FILE).is_file():
        raise ConfigError(
            f"fit: {os.fspath(path)} was saved without its optimizer state (from parameters, or with "
            "include_optimizer=False), so it cannot be resumed; start from it with params= and model_state="
        )
    return os.fspath(path)


__all__ = [
    "FitInputs",
    "FitInterrupted",
    "FitResult",
    "TrainData",
    "fit",
    "fresh_run_dir",
    "preference_start",
    "run_fit",
]
