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
import logging
import time
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxnn import compile_cache
from jaxnn.callbacks import Callback, NonFiniteError, NonFiniteGuard, RunInfo
from jaxnn.checkpoint import Checkpointer, CheckpointError, StopSignal, config_differences, state_digest
from jaxnn.config import ConfigError, FitConfig
from jaxnn.data.datasets import ImageDataset, TextCorpus
from jaxnn.data.pipeline import PipelineConfig
from jaxnn.data.prefetch import DevicePrefetch
from jaxnn.data.sources import as_eval_batches, as_train_source
from jaxnn.layers.core import Layer
from jaxnn.mesh import check_batch_divisible, create_sharded_state, make_mesh, process_slice
from jaxnn.optional import installed
from jaxnn.parallel import data_parallel_train_step
from jaxnn.plots import preload as preload_plotting
from jaxnn.precision import all_finite, get_policy
from jaxnn.rundir import RunFiles
from jaxnn.sharding import make_sharded_mesh
from jaxnn.train import (
    LossFn,
    TrainState,
    create_train_state,
    make_eval_step,
    make_optimizer,
    masked_classification_loss,
    train_step_fn,
)

log = logging.getLogger(__name__)

# What `fit` trains and evaluates on (see jaxnn.data.sources): arrays, a dict of arrays, a data set, batches.
TrainData: TypeAlias = tuple[Any, Any] | dict[str, Any] | ImageDataset | TextCorpus | Iterable[dict[str, Any]]


class FitResult(NamedTuple):
    state: TrainState  # the final train state (replicated over the mesh)
    history: list[dict]  # every train and eval row this call wrote, in order
    summary: dict  # what summary.json holds


def fit(
    model: Layer,
    data: TrainData,
    *,
    loss: LossFn = masked_classification_loss,
    optimizer: optax.GradientTransformation | None = None,
    eval_data: TrainData | None = None,
    callbacks: Iterable[Callback] = (),
    mesh: Mesh | str | None = None,
    pipeline: PipelineConfig | None = None,
    config: dict | None = None,
    params: Any = None,
    model_state: Any = None,
    **settings: Any,
) -> FitResult:
    """Trains `model` on `data` and returns `FitResult(state, history, summary)`.

    model: any `jaxnn.layers.Layer`; its input is `batch["x"]`.
    data: `(x, y)` arrays, a dict of arrays, a jaxnn data set, or an iterable of batch dicts (see
      `jaxnn.data.sources`); `eval_data` likewise (arrays are padded and masked so every example counts once).
    loss: `(logits, batch) -> (loss, metrics)`; a `count` metric, if returned, weights evaluation batches.
    optimizer: any optax `GradientTransformation` (default: `make_optimizer(1e-3, total_steps=steps)`).
    callbacks: `jaxnn.callbacks.Callback`s; a `NonFiniteGuard` is added unless `guard_nonfinite=False`.
    mesh: a `jax.sharding.Mesh` with a `data` axis and optionally `fsdp` and `tensor` axes, or its sizes as text
      ("data=2,fsdp=4", see `jaxnn.sharding`) (default: `devices` local devices on a `data` axis, or all devices
      of all processes in a multi-process run).
    pipeline: a `PipelineConfig` for jaxnn data sets (workers, augmentation).
    config: JSON-able facts about the run (model and optimizer settings) saved in config.json and the
      checkpoints; a resume with different facts is refused, naming them.
    params, model_state: start from these (e.g. `jaxnn.finetune.load_into` of a trained model's) instead of the
      model's initialisation; they must have the shapes the model's init gives, and their digest joins the record.
    settings: the fields of `jaxnn.config.FitConfig` (steps, batch_size, precision, run_dir, resume, ...).
    """
    cfg = FitConfig.from_settings(settings)
    compile_cache.enable(cfg.compile_cache)
    if pipeline is not None and cfg.batch_size not in (None, pipeline.batch_size):
        raise ConfigError(f"fit: batch_size {cfg.batch_size} differs from the pipeline's {pipeline.batch_size}")
    source = as_train_source(data, pipeline, cfg.batch_size, cfg.seed, check=cfg.check_data)
    example = source.example()
    batch_size = _batch_size(example)
    cfg = dataclasses.replace(cfg, batch_size=batch_size)  # an iterable's own batch size is what the run records
    evals = as_eval_batches(
        eval_data, batch_size, seq_len=getattr(pipeline, "seq_len", 128), seed=cfg.seed, check=cfg.check_data
    )
    tx = optimizer if optimizer is not None else make_optimizer(1e-3, total_steps=cfg.steps)
    if isinstance(mesh, str):
        mesh = make_sharded_mesh(mesh)
    elif mesh is None:
        mesh = make_mesh(None if jax.process_count() > 1 else _devices(cfg.devices))
    check_batch_divisible(batch_size, mesh)
    files = RunFiles(cfg, _json_record({**cfg.record(), **(config or {})}), is_main=jax.process_index() == 0)
    files.precheck()  # a run dir in use is refused now, before anything is compiled
    start_from = _starting_point(model, example["x"].shape, params, model_state)
    state = create_sharded_state(lambda: _initial_state(model, tx, cfg, example["x"].shape, params, model_state), mesh)
    _check_step_runs(model, loss, tx, cfg.precision, state, example)
    record = _json_record({**cfg.record(), **(config or {}), **_model_record(state.params), **start_from})
    files.record = record
    files.open()  # the run dir is checked and locked here; nothing was written before
    try:
        return _train(model, loss, tx, cfg, source, evals, mesh, state, record, files, list(callbacks))
    finally:
        files.close()


def _train(model, loss, tx, cfg, source, evals, mesh, state, record, files, callbacks) -> FitResult:
    dp = data_parallel_train_step(model, loss, tx, cfg.precision, mesh=mesh, form=cfg.form)
    ckpt = (
        Checkpointer(files.ckpt_dir, keep=cfg.keep, save_every=cfg.ckpt_every, async_save=cfg.async_checkpoints)
        if files.ckpt_dir
        else None
    )
    state, start = _restore(ckpt, state, record, source, cfg, files)
    if start >= cfg.steps:
        return _already_finished(ckpt, state, start, files)
    rows = process_slice(_batch_size(source.example()), mesh) if jax.process_count() > 1 else slice(None)
    place = lambda host: dp.place_batch(jax.tree.map(lambda x: x[rows], host))  # noqa: E731
    batches = DevicePrefetch(source.iterator(start, cfg.steps), place=place, size=cfg.prefetch)
    eval_step = make_eval_step(model, loss, cfg.precision)
    run = RunInfo(cfg.steps, cfg.run_dir, files.is_main, start, start, state, get_policy(cfg.precision).loss_scaling)
    if cfg.guard_nonfinite and not any(isinstance(c, NonFiniteGuard) for c in callbacks):
        callbacks = [NonFiniteGuard(), *callbacks]
    if cfg.profile_dir:
        from jaxnn.trace import TraceSteps

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
                state, metrics = dp.step(state, next(batches))
                run.step, run.state = step, state
                tracker.after_step(step, metrics)  # reads the previous step's metrics: the device runs on
                if step % cfg.log_every == 0 or step == cfg.steps:
                    tracker.log(step, batches.take_wait())
                if evals and (step % cfg.eval_interval() == 0 or step == cfg.steps):
                    eval_metrics = tracker.eval(step, _evaluate(eval_step, state, evals, place))
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
    return FitResult(state, tracker.history, summary)


# ------------------------------------------------------------------------------------------------------- setup


def _devices(n: int) -> int:
    if n > jax.local_device_count():
        raise ConfigError(f"devices {n}: only {jax.local_device_count()} {jax.default_backend()} devices here")
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
    from jaxnn.layers.core import init_model
    from jaxnn.pytree import shapes

    _, init_params, init_state = jax.eval_shape(lambda k: init_model(model, k, in_shape), jax.random.key(0))
    record = {}
    for part, given, own in (("params", params, init_params), ("model_state", model_state, init_state)):
        if given is None:
            continue
        theirs, ours = shapes(given), shapes(own)
        diffs = [
            f"{n}: given {theirs.get(n, '-')}, model {ours.get(n, '-')}"
            for n in sorted(set(theirs) | set(ours))
            if theirs.get(n) != ours.get(n)
        ]
        if diffs:
            raise ConfigError(
                f"fit: the {part} given do not fit the model ({len(diffs)} differ: "
                f"{'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''})"
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


def _check_step_runs(model, loss, tx, precision, state, example) -> None:
    """Traces the step on the batch's shapes (no compile, no FLOPs) so a model/loss/data mismatch is one line."""
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), example)
    try:
        jax.eval_shape(train_step_fn(model, loss, tx, precision), state, batch)
    except Exception as err:  # noqa: BLE001 - any failure here is the model, the loss or the data
        shapes = {k: f"{v.dtype}{list(v.shape)}" for k, v in batch.items()}
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the model and loss cannot run on a batch {shapes}: {type(err).__name__}: {reason[:300]}"
        ) from err


def _json_record(record: dict) -> dict:
    """`record` as it reads back from JSON (tuples become lists), so a saved copy compares equal to it."""
    import json

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


def _save(ckpt, step, state, source, record, tracker, force=False) -> None:
    if not (force or ckpt.should_save(step)):
        return
    if not bool(all_finite(state.params)):
        raise NonFiniteError(
            f"the parameters are not finite at step {step}; not checkpointed (the newest "
            f"checkpoint, step {ckpt.latest_step()}, is kept)"
        )
    if ckpt.save(step, state, data_state=source.state(step), config=record, force=force):
        tracker.checkpointed(step)


def _evaluate(eval_step, state, batches, place) -> dict:
    """Metrics over all `batches`, each batch weighted by its count of real examples."""
    totals: dict[str, float] = {}
    total_count = 0.0
    for host in batches:
        m = jax.device_get(eval_step(state, place(host)))
        count = (
            float(m.pop("count"))
            if "count" in m
            else float(np.sum(host["mask"]))
            if "mask" in host
            else float(_batch_size(host))
        )
        total_count += count
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + float(v) * count
    return {k: v / max(total_count, 1.0) for k, v in totals.items()}


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
        from jaxnn.optional import available

        self.cfg, self.files, self.callbacks, self.run, self.batch_size = cfg, files, callbacks, run, batch_size
        self.pending: tuple[int, dict] | None = None
        self.sums: dict[str, float] = {}
        self.n = self.steps_done = self.skipped = self.skipped_total = 0
        self.wait_total = 0.0
        self.history: list[dict] = []
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
            loss=f"{m['loss']:.4f}", **({"skipped": self.skipped_total} if "grads_finite" in m else {}), refresh=False
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
        )
        self.sums, self.n, self.skipped = {}, 0, 0
        self.t_interval = time.perf_counter()

    def eval(self, step: int, metrics: dict) -> dict:
        self._write({"split": "eval", "step": step, **metrics})
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
            "param_digest": state_digest(state.params),
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }
        if self.run.uses_loss_scaling:
            summary["skipped_steps"] = self.skipped_total
        for c in self.callbacks:
            c.on_end(self.run, summary)
        return summary


__all__ = ["FitResult", "fit"]
