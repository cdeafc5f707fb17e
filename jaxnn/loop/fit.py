"""The public training loop: `jaxnn.fit(model, data, ...)` trains any Layer with any loss and optax optimizer.

    result = jaxnn.fit(model, (x, y), steps=500, batch_size=64, eval_data=(x_test, y_test), run_dir="runs/a")
    result.state, result.history, result.summary

Setup refuses bad input (config, data, model/loss on a batch, run directory) before anything is written. Then:
host batches -> device prefetch onto the step's sharding -> the jitted, donated step -> metrics read one step
late (the device never waits on the host) -> callbacks, metric writers, progress bar -> evaluation ->
checkpoints (orbax, with the data position) -> summary.json and plots. SIGTERM/SIGINT end the run with a
checkpoint; a resumed run continues bitwise as if never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import signal
import time
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxnn._src import compile_cache as xla_cache
from jaxnn._src.optional import installed
from jaxnn.augment import Augment, augment_batch, parse_augment
from jaxnn.callbacks import Callback, NonFiniteError, NonFiniteGuard, RunInfo
from jaxnn.checkpoint import Checkpointer, CheckpointError, StopSignal, load_train_state, state_digest
from jaxnn.config import ConfigError, FitConfig, config_differences, first_differences
from jaxnn.data.datasets import DataError, ImageDataset, TextCorpus
from jaxnn.data.pipeline import PipelineConfig
from jaxnn.data.prefetch import DevicePrefetch
from jaxnn.data.sources import as_eval_batches, as_train_source
from jaxnn.evaluation import eval_sums_fn, mean_over, metric_names, padded, round_up
from jaxnn.layers.core import Layer
from jaxnn.loop.plots import preload as preload_plotting
from jaxnn.loop.rundir import RunFiles
from jaxnn.parallel import data_parallel_train_step
from jaxnn.parallel.mesh import batch_devices, check_batch_divisible, make_mesh, process_slice
from jaxnn.parallel.placement import create_sharded_state
from jaxnn.parallel.rules import RulesLike
from jaxnn.precision import all_finite, get_policy
from jaxnn.train import (
    LossFn,
    TrainState,
    classification_loss,
    create_train_state,
    forward_batch,
    make_optimizer,
    masked_classification_loss,
    train_step_fn,
)

log = logging.getLogger(__name__)

# What `fit` trains and evaluates on (see jaxnn.data.sources): arrays, a dict of arrays, a data set, batches.
TrainData: TypeAlias = tuple[Any, Any] | dict[str, Any] | ImageDataset | TextCorpus | Iterable[dict[str, Any]]


class FitResult(NamedTuple):
    state: TrainState  # the final train state (replicated over the mesh), or the best one a callback restored
    history: list[dict]  # every train and eval row this call wrote, in order
    summary: dict  # what summary.json holds


class FitInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended `fit`: the checkpoint and summary.json were written first; `.result` is what `fit`
    would have returned."""

    def __init__(self, message: str, result: FitResult):
        super().__init__(message)
        self.result = result


def fit(
    model: Layer,
    data: TrainData,
    *,
    loss: LossFn = masked_classification_loss,
    optimizer: optax.GradientTransformation | None = None,
    eval_data: TrainData | None = None,
    callbacks: Iterable[Callback] = (),
    mesh: Mesh | str | None = None,
    sharding_rules: RulesLike | None = None,
    pipeline: PipelineConfig | None = None,
    augment: Augment | str | None = None,
    config: dict | None = None,
    params: Any = None,
    model_state: Any = None,
    init_from: str | os.PathLike[str] | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int | None = 64,
    accumulate: int = 1,
    precision: str = "fp32",
    seed: int = 0,
    eval_every: int = 0,
    log_every: int = 50,
    ckpt_every: int = 0,
    keep: int = 3,
    keep_best: str | None = None,
    keep_best_mode: str = "min",
    run_dir: str | None = None,
    ckpt_dir: str | None = None,
    resume: bool = False,
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
    **unknown: Any,
) -> FitResult:
    """Trains `model` on `data` and returns `FitResult(state, history, summary)`.

    model: any `jaxnn.layers.Layer`; its input is `batch["x"]`.
    data: `(x, y)` arrays, a dict of arrays, a jaxnn data set, or an iterable of batch dicts (see
      `jaxnn.data.sources`); `eval_data` likewise. Evaluation is exact for any loss (`jaxnn.evaluation`).
    loss: `(logits, batch) -> (loss, metrics)`, a mean over the batch's examples; a `count` metric, if
      returned, weights each example in evaluation.
    optimizer: any optax `GradientTransformation` (default: `make_optimizer(1e-3, total_steps=steps)`); one that
      takes `value` (`optax.contrib.reduce_on_plateau`) gets the step's training loss.
    callbacks: `jaxnn.callbacks.Callback` instances; a `NonFiniteGuard` is added unless `guard_nonfinite=False`.
    mesh: a `jax.sharding.Mesh` with a `data` axis and optionally `fsdp` and `tensor` axes, or its sizes as text
      ("data=2,fsdp=4", see `jaxnn.parallel.make_mesh`) (default: `devices` local devices on a `data` axis, or all
      devices of all processes in a multi-process run).
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
    steps, epochs, batch_size, ...: the fields of `jaxnn.config.FitConfig`, which documents and validates them;
      give `steps` or `epochs`, not both. Any other keyword is refused with the list of known ones.

    Ctrl-C (SIGINT) saves a checkpoint and summary.json, then raises `FitInterrupted` (a KeyboardInterrupt);
    SIGTERM does the same and returns normally.
    """
    # Long only in its signature and docstring: every FitConfig field is a keyword so that help() and editors list
    # them; the body hands each stage to a function of its own.
    values = dict(locals())
    cfg = _fit_config(values, unknown)
    xla_cache.enable(cfg.compile_cache)
    if pipeline is not None and cfg.batch_size not in (None, pipeline.batch_size):
        raise ConfigError(f"fit: batch_size {cfg.batch_size} differs from the pipeline's {pipeline.batch_size}")
    callbacks = _checked_callbacks(callbacks)
    source = as_train_source(data, pipeline, cfg.batch_size, cfg.seed, check=cfg.check_data)
    example = source.example()
    batch_size = _batch_size(example)
    cfg = _steps_of(dataclasses.replace(cfg, batch_size=batch_size), source)  # an iterable's own batch size counts
    evals = as_eval_batches(
        eval_data, batch_size, seq_len=getattr(pipeline, "seq_len", 128), seed=cfg.seed, check=cfg.check_data
    )
    tx = optimizer if optimizer is not None else make_optimizer(1e-3, total_steps=cfg.steps)
    aug = _augmentation(augment, model, cfg, example)
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    elif mesh is None:
        mesh = make_mesh(None if jax.process_count() > 1 else _devices(cfg.devices))
    check_batch_divisible(batch_size, mesh)
    _check_accumulate(cfg, mesh)
    # fit's own optimizer decays to `steps`, so there `steps` fixes the results; a caller's optimizer decides.
    base = {**cfg.record(), **({"steps": cfg.steps} if optimizer is None else {}), **(config or {})}
    if aug is not None:
        base["augment"] = aug.record()
    _refuse_longer_default_schedule(cfg, optimizer)
    files = RunFiles(cfg, _json_record(base), is_main=jax.process_index() == 0)
    files.precheck()  # a run dir in use is refused now, before anything is compiled
    if init_from is not None and (params is not None or model_state is not None):
        raise ConfigError("fit: init_from and params/model_state exclude each other")
    start_from = _starting_point(model, example["x"].shape, params, model_state)
    state = create_sharded_state(
        lambda: _initial_state(model, tx, cfg, example["x"].shape, params, model_state), mesh, sharding_rules
    )
    if init_from is not None:
        state, start_from = _state_from(init_from, state)
    _check_step_runs(model, loss, tx, cfg, state, example, source, aug)
    _check_eval_data(evals, example, model, loss, state)
    _check_monitors(callbacks, cfg, evals, model, loss, state)
    record = _json_record({**base, **_model_record(state.params), **start_from})
    files.record = record
    files.open()  # the run dir is checked and locked here; nothing was written before
    try:
        result, interrupted = _train(model, loss, tx, cfg, source, evals, mesh, state, record, files, callbacks, aug)
    finally:
        files.close()
    if interrupted:
        raise FitInterrupted(f"fit: interrupted (Ctrl-C) at step {result.summary['step']}; checkpoint saved", result)
    return result


def _train(model, loss, tx, cfg, source, evals, mesh, state, record, files, callbacks, aug) -> tuple[FitResult, bool]:
    dp = data_parallel_train_step(
        model, loss, tx, cfg.precision, mesh=mesh, form=cfg.form, accumulate=cfg.accumulate, augment=_step_fn(aug)
    )
    ckpt = (
        Checkpointer(
            files.ckpt_dir,
            keep=cfg.keep,
            save_every=0 if cfg.keep_best else cfg.ckpt_every,  # keep_best saves at every evaluation instead
            async_save=cfg.async_checkpoints,
            keep_best=cfg.keep_best,
            best_mode=cfg.keep_best_mode,
        )
        if files.ckpt_dir
        else None
    )
    state, start = _restore(ckpt, state, record, source, cfg, files)
    if start >= cfg.steps:
        return _already_finished(ckpt, state, start, files), False
    place = _placer(dp, mesh, _batch_size(source.example()))
    batches = DevicePrefetch(source.iterator(start, cfg.steps), place=place, size=cfg.prefetch)
    evaluate = _evaluator(model, loss, cfg, mesh, dp, evals)
    run = RunInfo(cfg.steps, cfg.run_dir, files.is_main, start, start, state, get_policy(cfg.precision).loss_scaling)
    if cfg.guard_nonfinite and not any(isinstance(c, NonFiniteGuard) for c in callbacks):
        callbacks = [NonFiniteGuard(), *callbacks]
    if cfg.profile_dir:
        from jaxnn.profile.trace import TraceSteps

        callbacks = [*callbacks, TraceSteps(cfg.profile_dir)]
    tracker = _Tracker(cfg, files, callbacks, run, _batch_size(source.example()))
    if cfg.plots and files.run_dir and files.is_main and installed("matplotlib"):
        preload_plotting()
    for c in callbacks:
        c.on_start(run)

    step, eval_metrics, failure = start, {}, None
    with StopSignal() as stop, _closing(ckpt):
        try:
            for step in range(start + 1, cfg.steps + 1):
                batch = _next_batch(batches, step, run)
                if batch is None:
                    step -= 1
                    break
                state, metrics = dp.step(state, batch)
                run.step, run.state = step, state
                tracker.after_step(step, metrics)  # reads the previous step's metrics: the device runs on
                if step % cfg.log_every == 0 or step == cfg.steps:
                    tracker.log(step, batches.take_wait())
                evaluated = evals and (step % cfg.eval_interval() == 0 or step == cfg.steps)
                if evaluated:
                    eval_metrics = tracker.eval(step, evaluate(state))
                if ckpt and cfg.keep_best and evaluated and step < cfg.steps:
                    _save(ckpt, step, state, source, record, tracker, force=True, metrics=eval_metrics)
                if ckpt and ckpt.should_save(step):
                    _save(ckpt, step, state, source, record, tracker)
                if stop or run.stop_reason:
                    break
            tracker.finish_steps()
            if ckpt:
                _save(ckpt, step, state, source, record, tracker, force=True)
                ckpt.close()
        except NonFiniteError as err:
            failure = err
    summary = tracker.summary(step, start, state, eval_metrics, stop, failure, batches.take_wait())
    files.finish(summary, plots=cfg.plots and failure is None)
    if failure is not None:
        raise failure
    result = FitResult(run.result_state if run.result_state is not None else state, tracker.history, summary)
    return result, stop.received == signal.SIGINT


def _next_batch(batches: DevicePrefetch, step: int, run: RunInfo) -> Any:
    """The next device batch, or None when a one-shot iterator has run out (the run then ends cleanly)."""
    try:
        return next(batches)
    except StopIteration:
        reason = f"the data ran out after {step - 1} steps"
        log.warning("fit: %s; ending the run there (checkpoint and summary follow)", reason)
        run.request_stop(reason)
        return None


def _placer(dp, mesh, rows_per_batch: int):
    """Host batch -> device batch; with many processes each keeps its own rows of the global batch."""
    rows = process_slice(rows_per_batch, mesh) if jax.process_count() > 1 else slice(None)
    return lambda host: dp.place_batch(jax.tree.map(lambda x: x[rows], host))


def _evaluator(model, loss, cfg, mesh, dp, evals):
    """`state -> metrics` over every evaluation example exactly once (see jaxnn.evaluation), compiled once."""
    if not evals:
        return None
    split = batch_devices(mesh)
    size = max(round_up(int(np.shape(b["x"])[0]), split) for b in evals)
    place = _placer(dp, mesh, size)
    sums = jax.jit(eval_sums_fn(model, loss, cfg.precision))
    return lambda state: mean_over(
        lambda b: sums(state.params, state.model_state, b), (place(padded(h, size)) for h in evals)
    )


def fresh_run_dir(root: str | os.PathLike[str] = "runs") -> str:
    """A new, not yet existing run directory `<root>/<YYYYmmdd-HHMMSS>` (with `-2`, `-3`, ... when taken).

    For a script run again and again: `fit(..., run_dir=jaxnn.fresh_run_dir("runs/mine"))` writes each run
    beside the last instead of being refused by the run directory the previous one left (`resume=True` with a
    fixed run_dir continues one run instead).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(root) / stamp
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{stamp}-{n}")
    return str(candidate)


# ------------------------------------------------------------------------------------------------------- setup


def _devices(n: int) -> int:
    if n > jax.local_device_count():
        hint = (
            f"; call jaxnn.parallel.configure_cpu_devices({n}) before jax starts, or run `jaxnn train --devices {n}`"
            if jax.default_backend() == "cpu"
            else ""
        )
        raise ConfigError(f"devices {n}: only {jax.local_device_count()} {jax.default_backend()} devices here{hint}")
    return n


def _batch_size(batch: dict) -> int:
    if not isinstance(batch, dict) or "x" not in batch:
        raise ConfigError(
            f"data: batches must be dicts with an input 'x' (and targets, e.g. 'y'), got "
            f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, dict) else ''}"
        )
    return int(np.shape(batch["x"])[0])


def _starting_point(model: Layer, in_shape: Any, params: Any, model_state: Any) -> dict:
    """Checks given starting params/state against the model's own; their digest for the run's record."""
    if params is None and model_state is None:
        return {}
    from jaxnn._src.pytree import shapes
    from jaxnn.layers.core import init_model

    _, init_params, init_state = jax.eval_shape(lambda k: init_model(model, k, in_shape), jax.random.key(0))
    record = {}
    for part, given, own in (("params", params, init_params), ("model_state", model_state, init_state)):
        if given is None:
            continue
        theirs, ours = shapes(given), shapes(own)
        diffs = config_differences(theirs, ours, saved_as="given", now_as="model")
        if diffs:
            raise ConfigError(
                f"fit: the {part} given do not fit the model ({len(diffs)} differ: {first_differences(diffs)})"
            )
        record[f"initial_{part}"] = state_digest(given)[:16]
    return record


def _initial_state(model: Layer, tx: Any, cfg: FitConfig, in_shape: Any, params: Any, model_state: Any) -> Any:
    state = create_train_state(model, tx, jax.random.key(cfg.seed), in_shape, cfg.precision)
    if params is not None:
        params = get_policy(cfg.precision).cast_to_param(params)
        state = state._replace(params=params, opt_state=tx.init(params))
    if model_state is not None:
        state = state._replace(model_state=model_state)
    return state


def _augmentation(augment, model, cfg, example) -> Any:
    """fit's `augment` as an `Augment` with the model's classes filled in, or None; bad settings are one line."""
    if augment is None:
        return None
    try:
        aug = parse_augment(augment) if isinstance(augment, str) else augment
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    if not isinstance(aug, Augment):
        raise ConfigError(f"fit: augment must be a jaxnn.augment.Augment or its text, got {type(augment).__name__}")
    aug.check_available()
    if aug.mixes and aug.num_classes is None:
        out = _output_spec(model, cfg.precision, _initial_spec(model, cfg, example), _spec(example))
        if out is None or not hasattr(out, "shape"):
            raise ConfigError("fit: mixup and cutmix need Augment(num_classes=...); the model's output gives none")
        aug = dataclasses.replace(aug, num_classes=int(out.shape[-1]))
    return aug


def _initial_spec(model, cfg, example) -> Any:
    """The shapes of a fresh train state (no FLOPs): enough to read the model's output shape."""
    return jax.eval_shape(
        lambda k: create_train_state(model, optax.sgd(0.0), k, np.shape(example["x"]), cfg.precision),
        jax.random.key(0),
    )


def _step_fn(aug) -> Any:
    if aug is None:
        return None
    return functools.partial(augment_batch, aug)


def _check_step_runs(model, loss, tx, cfg, state, example, source, aug=None) -> None:
    """Traces the step on the batch's shapes (no compile, no FLOPs) so a model/loss/data mismatch is one line."""
    batch = _spec(example)
    shapes = {k: f"{v.dtype}{list(v.shape)}" for k, v in batch.items()}
    logits = _output_spec(model, cfg.precision, state, batch)
    if logits is not None:
        if _is_classification(loss):
            _check_labels(logits, example, _all_labels(source, example), shapes)
        _check_loss_output(loss, logits, batch)
    try:
        step = train_step_fn(model, loss, tx, cfg.precision, accumulate=cfg.accumulate, augment=_step_fn(aug))
        jax.eval_shape(step, state, batch)
    except Exception as err:  # noqa: BLE001 - any failure here is the model, the loss or the data
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the model and loss cannot run on a batch {shapes}: {type(err).__name__}: {reason[:300]}"
        ) from err


def _spec(batch: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}


def _output_spec(model, precision, state, batch) -> Any:
    """The model's output shape on `batch` (eval mode), or None when the model cannot run (reported next)."""
    policy = get_policy(precision)
    try:
        return jax.eval_shape(
            lambda s, b: forward_batch(model, policy, s.params, s.model_state, b, key=None, train=False)[0],
            state,
            batch,
        )
    except Exception:  # noqa: BLE001 - the step's trace that follows names the failure
        return None


def _is_classification(loss) -> bool:
    while isinstance(loss, functools.partial):
        loss = loss.func
    return loss in (masked_classification_loss, classification_loss)


def _all_labels(source, example: dict) -> Any:
    """Every training label where they are at hand (arrays, an image data set), else the first batch's."""
    arrays = getattr(getattr(source, "_batches", None), "arrays", None)
    if arrays is not None and "y" in arrays:
        return arrays["y"]
    data = getattr(source, "data", None)
    return data.y_train if isinstance(data, ImageDataset) else example.get("y")


def _check_labels(logits, example: dict, labels: Any, shapes: dict, role: str = "data") -> None:
    """Integer class labels, one per output row, inside the model's classes: else one line naming what is wrong."""
    if not hasattr(logits, "shape") or "y" not in example:
        return
    y = np.asarray(example["y"])
    classes = logits.shape[-1]
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(
            f"the model and loss cannot run on a batch {shapes}: {role} labels 'y' are {y.dtype}; the "
            f"classification loss wants integer class indices (e.g. y.astype(np.int32))"
        )
    if y.shape != tuple(logits.shape[:-1]):
        raise ConfigError(
            f"the model and loss cannot run on a batch {shapes}: {role} labels 'y' have shape {y.shape}, the "
            f"model's output {tuple(logits.shape)} wants {tuple(logits.shape[:-1])} (one class index per row; "
            "e.g. y.reshape(-1))"
        )
    labels = np.asarray(labels)
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        raise DataError(
            f"{role}: labels 'y' run from {low} to {high}, outside the model's {classes} classes (0..{classes - 1})"
        )


def _check_loss_output(loss, logits, batch) -> None:
    """A loss must return (loss, metrics): a scalar and a dict of arrays."""
    try:
        out = jax.eval_shape(loss, logits, batch)
    except Exception:  # noqa: BLE001 - the step's trace that follows names the failure
        return
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) and np.shape(out[0]) == ():
        return
    got = (
        f"a {out.dtype}{list(out.shape)} array"
        if hasattr(out, "shape")
        else f"{type(out).__name__} of {len(out)}"
        if isinstance(out, (tuple, list))
        else type(out).__name__
    )
    raise ConfigError(
        f"loss {getattr(loss, '__name__', type(loss).__name__)}: must return (loss, metrics), a scalar and a "
        f"dict (e.g. `return loss, {{}}`), got {got}"
    )


def _check_eval_data(evals, example, model, loss, state) -> None:
    """Evaluation batches with the training batches' keys, per-example shapes and kinds of dtype."""
    if not evals:
        return
    first = evals[0]
    for key in sorted(set(example) - {"mask"}):
        if key not in first:
            raise DataError(f"eval_data: has no {key!r}, which the training batches have (keys {sorted(first)})")
        got, want = np.asarray(first[key]), np.asarray(example[key])
        if got.shape[1:] != want.shape[1:] or got.dtype.kind != want.dtype.kind:
            raise DataError(
                f"eval_data: {key!r} is {got.dtype}{list(got.shape[1:])} per example, the training data's "
                f"{want.dtype}{list(want.shape[1:])}"
            )
    if _is_classification(loss) and "y" in first:
        classes = getattr(_output_spec(model, "fp32", state, _spec(example)), "shape", (None,))[-1]
        labels = np.concatenate([np.asarray(b["y"]).ravel() for b in evals])
        if classes is not None and (labels.min() < 0 or labels.max() >= classes):
            raise DataError(
                f"eval_data: labels 'y' run from {labels.min()} to {labels.max()}, outside the model's "
                f"{classes} classes (0..{classes - 1})"
            )


def _check_monitors(callbacks, cfg, evals, model, loss, state) -> None:
    """Every evaluation metric a callback or keep_best watches exists, and there is evaluation data to watch."""
    watched = [(type(c).__name__, m) for c in callbacks for m in c.monitors()]
    watched += [("keep_best", cfg.keep_best)] if cfg.keep_best else []
    if not watched:
        return
    if not evals:
        who, metric = watched[0]
        raise ConfigError(f"{who} monitors the evaluation metric {metric!r}, but fit has no eval_data")
    names = metric_names(model, loss, cfg.precision, state.params, state.model_state, evals[0])
    for who, metric in watched:
        if metric not in names:
            raise ConfigError(f"{who} monitors {metric!r}, but the evaluation reports {names}")


def _checked_callbacks(callbacks) -> list[Callback]:
    callbacks = list(callbacks)
    for i, c in enumerate(callbacks):
        if isinstance(c, type) and issubclass(c, Callback):
            raise ConfigError(f"callbacks[{i}]: the class {c.__name__}, not an instance; pass {c.__name__}(...)")
        if not isinstance(c, Callback):
            raise ConfigError(
                f"callbacks[{i}]: {type(c).__name__} is not a jaxnn.callbacks.Callback (subclass it and override "
                "the hooks it needs)"
            )
    return callbacks


def _fit_config(values: dict, unknown: dict) -> FitConfig:
    """The FitConfig of fit's keywords (FitConfig validates them); `steps` and `epochs` exclude each other."""
    settings = {f.name: values[f.name] for f in dataclasses.fields(FitConfig)}
    if settings["steps"] is not None and settings["epochs"] is not None:
        raise ConfigError(f"fit: give steps or epochs, not both (got steps {settings['steps']} and epochs)")
    if settings["steps"] is None:
        del settings["steps"]  # FitConfig's default, or what `epochs` makes of it
    return FitConfig.from_settings({**settings, **unknown})


def _steps_of(cfg: FitConfig, source) -> FitConfig:
    """`epochs` as steps: passes times the data's batches per pass."""
    if cfg.epochs is None:
        return cfg
    per_epoch = source.steps_per_epoch()
    if per_epoch is None:
        raise ConfigError("fit: epochs needs data of known length (arrays, a data set, a list); pass steps instead")
    return dataclasses.replace(cfg, steps=cfg.epochs * per_epoch)


def _check_accumulate(cfg: FitConfig, mesh: Mesh) -> None:
    n, rows = batch_devices(mesh), (cfg.batch_size or 0) // cfg.accumulate
    if cfg.accumulate > 1 and rows % n:
        raise ConfigError(
            f"fit: accumulate {cfg.accumulate} makes micro-batches of {rows} rows, which the {n} devices of "
            "the batch cannot split evenly"
        )


def _refuse_longer_default_schedule(cfg: FitConfig, optimizer) -> None:
    """A resume with other `steps` and fit's default optimizer: its schedule decays to `steps`, so it would not
    continue the run it resumes; one line says so (the record comparison alone would only name the field)."""
    if not (cfg.resume and optimizer is None and cfg.run_dir):
        return
    path = pathlib.Path(cfg.run_dir) / "config.json"
    try:
        saved = json.loads(path.read_text()).get("steps") if path.is_file() else None
    except Exception:  # noqa: BLE001 - a damaged config.json is reported by the run directory's own checks
        return
    if saved is not None and saved != cfg.steps:
        raise ConfigError(
            f"fit: resume with steps {cfg.steps}, but the run in {cfg.run_dir} was made for {saved}, and the "
            f"default optimizer's learning rate decays to 0 at `steps`; pass optimizer= with a schedule that does "
            f"not depend on steps (e.g. optax.adam(1e-3)) from the start, or resume with steps={saved}"
        )


def _state_from(path, state) -> tuple[Any, dict]:
    """Another run's whole train state as this run's starting point, at step 0 with this run's key."""
    restored, step = load_train_state(path, state)
    restored = restored._replace(step=restored.step - restored.step, key=state.key)
    digest = state_digest((restored.params, restored.model_state, restored.opt_state))[:16]
    log.info("fit: starting from the state of %s (its step %d)", path, step)
    return restored, {"init_from": digest}


def _json_record(record: dict) -> dict:
    """`record` as it reads back from JSON (tuples become lists), so a saved copy compares equal to it."""
    try:
        return json.loads(json.dumps(record))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: config must hold JSON values (numbers, strings, lists, dicts): {err}") from None


def _model_record(params) -> dict:
    """The parameter count and a digest of the parameter shapes: a resume into another model is refused early."""
    import hashlib

    shapes = jax.tree_util.tree_flatten_with_path(params)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in shapes)
    return {
        "num_params": int(sum(np.prod(x.shape) for _, x in shapes)),
        "param_shapes": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def _restore(ckpt, state, record, source, cfg, files) -> tuple[Any, int]:
    if not (cfg.resume and ckpt):
        return state, 0
    restored = ckpt.restore(state, record)
    if restored is None:
        log.warning("resume: no checkpoint in %s; starting from step 0", ckpt.directory)
        return state, 0
    state, data_state, start = restored
    if data_state.get("next_step") != start:
        raise CheckpointError(
            f"checkpoint {ckpt.directory / str(start)}: data iterator at "
            f"{data_state.get('next_step')} but train state at step {start}"
        )
    # Same config, different data (e.g. a folder whose files changed) would shift every later batch.
    diffs = config_differences(data_state, source.state(start))
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt.directory / str(start)}: its data iterator does not fit this data ({'; '.join(diffs)})"
        )
    files.resumed_from(start)
    return state, start


def _already_finished(ckpt, state, start, files) -> FitResult:
    log.warning("the run in %s already finished at step %d; nothing to do", files.run_dir, start)
    if ckpt:
        ckpt.close()
    summary = {**files.previous_summary(), "already_finished": True, "step": start}
    return FitResult(state, [], summary)


@contextlib.contextmanager
def _closing(ckpt):
    """On any way out, waits for the checkpoint in flight, so an error never leaves a save half-done."""
    try:
        yield
    finally:
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as err:  # noqa: BLE001 - the error that got us here is the one to report
                log.warning("while stopping: %s", err)


def _save(ckpt, step, state, source, record, tracker, force=False, metrics=None) -> None:
    if not (force or ckpt.should_save(step)):
        return
    if not bool(all_finite(state.params)):
        raise NonFiniteError(
            f"the parameters are not finite at step {step}; not checkpointed (the newest "
            f"checkpoint, step {ckpt.latest_step()}, is kept)"
        )
    if ckpt.save(step, state, data_state=source.state(step), config=record, force=force, metrics=metrics):
        tracker.checkpointed(step)


# --------------------------------------------------------------------------------------------------- bookkeeping


class _NoBar:
    """Stands in for tqdm's bar when there is none to show."""

    def update(self, n: int) -> None: ...

    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...

    def close(self) -> None: ...


def _progress_bar(show: bool, total: int, initial: int, desc: str) -> Any:
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc)


class _Tracker:
    """Metrics one step late, interval averages, skipped fp16 steps, rows, progress bar and callbacks."""

    def __init__(self, cfg: FitConfig, files: RunFiles, callbacks: list[Callback], run: RunInfo, batch_size: int):
        from jaxnn._src.optional import available

        self.cfg, self.files, self.callbacks, self.run, self.batch_size = cfg, files, callbacks, run, batch_size
        self.pending: tuple[int, dict] | None = None
        self.sums: dict[str, float] = {}
        self.n = self.steps_done = self.skipped = self.skipped_total = 0
        self.wait_total = 0.0
        self.history: list[dict] = []
        self.eval_postfix: dict[str, str] = {}  # the latest evaluation, kept in the bar beside the train numbers
        self.t_start = self.t_interval = time.perf_counter()
        show = cfg.progress and files.is_main and available("tqdm", "the progress bar")
        self.bar = _progress_bar(show, cfg.steps, run.start_step, cfg.name)

    def after_step(self, step: int, metrics) -> None:
        self._absorb()
        self.pending = (step, metrics)
        self.steps_done += 1
        self.bar.update(1)

    def _absorb(self) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        m = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        if "grads_finite" in m and not m["grads_finite"]:
            self.skipped += 1
            self.skipped_total += 1
        for k, v in m.items():
            if k not in ("grads_finite", "count"):
                self.sums[k] = self.sums.get(k, 0.0) + v
        self.n += 1
        for c in self.callbacks:
            c.on_step(self.run, step, m)
        self.bar.set_postfix(
            loss=f"{m['loss']:.4f}",
            **({"skipped": self.skipped_total} if "grads_finite" in m else {}),
            **self.eval_postfix,
            refresh=False,
        )

    def finish_steps(self) -> None:
        self._absorb()

    def log(self, step: int, wait: float) -> None:
        self._absorb()
        now = time.perf_counter()
        dt = now - self.t_interval
        self.wait_total += wait
        row: dict[str, Any] = {
            "split": "train",
            "step": step,
            **{k: v / max(self.n, 1) for k, v in self.sums.items()},
            "examples_per_s": self.n * self.batch_size / dt,
            "input_wait_s": wait,
            "input_wait_frac": wait / dt,
            "time_s": now - self.t_start,
        }
        if self.run.uses_loss_scaling:
            row["skipped_steps"] = self.skipped
        for c in self.callbacks:
            c.on_log(self.run, row)
        self._write(row)
        self.bar.set_postfix(
            loss=f"{row['loss']:.4f}",
            ex_s=f"{row['examples_per_s']:.0f}",
            wait=f"{100 * row['input_wait_frac']:.1f}%",
            **({"skipped": self.skipped_total} if self.run.uses_loss_scaling else {}),
            **self.eval_postfix,
        )
        self.sums, self.n, self.skipped = {}, 0, 0
        self.t_interval = time.perf_counter()

    def eval(self, step: int, metrics: dict) -> dict:
        self._write({"split": "eval", "step": step, **metrics})
        self.eval_postfix = {f"eval_{k}": f"{v:.4f}" for k, v in metrics.items()}
        self.bar.set_postfix(**self.eval_postfix)
        log.info("eval at step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        for c in self.callbacks:
            c.on_eval(self.run, step, metrics)
        return metrics

    def checkpointed(self, step: int) -> None:
        for c in self.callbacks:
            c.on_checkpoint(self.run, step)

    def _write(self, row: dict) -> None:
        self.history.append(row)
        self.files.write(row)

    def summary(self, step, start, state, eval_metrics, stop, failure, wait) -> dict:
        self.bar.close()
        elapsed = time.perf_counter() - self.t_start
        self.wait_total += wait
        summary = {
            "name": self.cfg.name,
            "step": step,
            "steps": self.cfg.steps,
            "resumed_from": start,
            "interrupted_by": stop.received,
            "signals_ignored": stop.ignored,
            "stopped_by": self.run.stop_reason,
            "error": str(failure) if failure else None,
            "time_s": elapsed,
            "examples_per_s": self.steps_done * self.batch_size / elapsed if elapsed else 0.0,
            "input_wait_frac": self.wait_total / elapsed if elapsed else 0.0,
            "run_dir": self.cfg.run_dir,
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }
        if self.run.uses_loss_scaling:
            summary["skipped_steps"] = self.skipped_total
        for c in self.callbacks:
            c.on_end(self.run, summary)
        # Of the state fit returns: a callback may have put another (e.g. the best) in its place.
        summary["param_digest"] = state_digest((self.run.result_state or state).params)
        return summary


__all__ = ["FitInterrupted", "FitResult", "fit", "fresh_run_dir"]
