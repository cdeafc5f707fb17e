"""The loop itself: `run_fit(model, data, cfg, inputs)` sets a run up (every check before anything is written),
then host batches -> device prefetch onto the step's sharding -> the jitted, donated step -> metrics read one step
late (the device never waits on the host) -> callbacks, metric writers, progress bar -> evaluation -> checkpoints
(orbax, with the data position) -> summary.json and plots. SIGTERM/SIGINT end the run with a checkpoint; a
resumed run continues bitwise as if never stopped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxnn._src import compile_cache as xla_cache
from jaxnn._src.optimizer_id import FIELD, fingerprint, remember
from jaxnn._src.optional import installed
from jaxnn._src.stop_signal import StopSignal
from jaxnn._src.warn import warn_at_caller
from jaxnn.augment import Augment
from jaxnn.callbacks import Callback, NonFiniteError, NonFiniteGuard, RunInfo, metric_mode
from jaxnn.checkpoint import Checkpointer, CheckpointError
from jaxnn.config import ConfigError, FitConfig, config_differences
from jaxnn.data.datasets import ImageDataset, TextCorpus
from jaxnn.data.pipeline import PipelineConfig
from jaxnn.data.prefetch import DevicePrefetch
from jaxnn.data.sources import as_eval_batches, as_train_source
from jaxnn.errors import UnusedDevicesWarning  # noqa: F401 (also importable from here)
from jaxnn.evaluation import eval_sums_fn, mean_over, padded, round_up
from jaxnn.layers.core import Layer, check_is_layer
from jaxnn.layers.stack import rematerialised
from jaxnn.loop._bookkeeping import Tracker
from jaxnn.loop._ema import ema_params, with_ema, with_ema_params
from jaxnn.loop._levers import Levers
from jaxnn.loop._resume_checks import refuse_other_optimizer
from jaxnn.loop._setup import (
    augment_fn,
    augmentation,
    batch_size_of,
    batch_spec,
    check_accumulate,
    check_eval_data,
    check_monitors,
    check_step_runs,
    checked_callbacks,
    checked_devices,
    fit_scores,
    local_value,
    output_spec,
    refuse_idle_resume,
    refuse_loss_ignoring_mixed_targets,
    refuse_resume_with_other_steps,
    steps_from_epochs,
)
from jaxnn.loop._start import initial_state, lora_start, starting_point, state_from
from jaxnn.loop.plots import preload as preload_plotting
from jaxnn.loop.rundir import RunFiles, input_record, json_record, model_record
from jaxnn.lora import LoRA
from jaxnn.parallel.mesh import MeshShape, batch_devices, check_batch_divisible, make_mesh, process_slice
from jaxnn.parallel.placement import create_sharded_state
from jaxnn.parallel.rules import RulesLike, as_rules
from jaxnn.precision import all_finite, get_policy
from jaxnn.saving import load_model, load_training_state
from jaxnn.train import LossFn, TrainState, make_optimizer, masked_classification_loss
from jaxnn.train.data_parallel import data_parallel_train_step

log = logging.getLogger("jaxnn.loop")

# What `fit` trains and evaluates on (see jaxnn.data.sources): arrays, a dict of arrays, a data set, batches.
TrainData: TypeAlias = tuple[Any, Any] | dict[str, Any] | ImageDataset | TextCorpus | Iterable[dict[str, Any]]


class FitResult(NamedTuple):
    state: TrainState  # the final train state (replicated over the mesh), or the best one a callback restored
    history: list[dict]  # every train and eval row this call wrote, in order; also by name: history["loss"]
    summary: dict  # what summary.json holds


class FitInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended `fit`: the checkpoint and summary.json were written first; `.result` is what `fit`
    would have returned."""

    def __init__(self, message: str, result: FitResult):
        super().__init__(message)
        self.result = result


class FitInputs(NamedTuple):
    """What a run is made of besides its `FitConfig`: the objects `fit` takes as keywords (see `jaxnn.fit`), which
    no JSON record can hold. `schedule_decays`: whether the optimizer's learning rate decays to 0 at `steps` (then
    `steps` joins the run's record and a resume with other steps is refused); None means "when `optimizer` is None"
    (fit's default optimizer decays)."""

    loss: LossFn = masked_classification_loss
    optimizer: optax.GradientTransformation | None = None
    eval_data: TrainData | None = None
    eval_metrics: Any = None  # names or jaxnn.scores.Score objects
    callbacks: Iterable[Callback] = ()
    mesh: Mesh | MeshShape | None = None  # text is fit's to convert (jaxnn.loop.fit), as are augment's and lora's
    sharding_rules: RulesLike | None = None
    pipeline: PipelineConfig | None = None
    augment: Augment | None = None
    config: dict | None = None
    params: Any = None
    model_state: Any = None
    init_from: str | os.PathLike[str] | None = None
    schedule_decays: bool | None = None
    lora: LoRA | None = None
    resume_from: str | None = None  # a jaxnn.save_model folder whose train state the run continues
    check_optimizer: bool = True  # False: a resume may change the optimizer or the default's steps (see fit)


def run_fit(model: Layer, data: TrainData, cfg: FitConfig, inputs: FitInputs | None = None) -> FitResult:
    """Trains `model` on `data` as `cfg` says, with `inputs`' loss, optimizer, callbacks, ...; what `jaxnn.fit`
    runs with the FitConfig it builds from its keywords, and `jaxnn train` with the one it builds from its flags.
    `cfg` is used as it is: only what the data fix (the steps of `epochs`, an iterable's batch size) is filled in."""
    inputs = FitInputs() if inputs is None else inputs
    check_is_layer(model, "fit: model")  # a constructor not yet called, named before anything else reads it
    if cfg.remat is not None:
        model = _rematerialised(model, cfg.remat)
    xla_cache.enable(cfg.compile_cache)
    pipeline = inputs.pipeline
    if pipeline is not None and cfg.batch_size not in (None, pipeline.batch_size):
        raise ConfigError(f"fit: batch_size {cfg.batch_size} differs from the pipeline's {pipeline.batch_size}")
    callbacks = checked_callbacks(inputs.callbacks)
    scores = fit_scores(inputs.eval_metrics)
    if inputs.sharding_rules is not None:  # a rules file is read first: its error is the run's only output line
        inputs = inputs._replace(sharding_rules=as_rules(inputs.sharding_rules))
    source = as_train_source(data, pipeline, cfg.batch_size, cfg.seed, check=cfg.check_data)
    example = source.example()
    batch_size = batch_size_of(example)  # an iterable's own batch size counts
    cfg = cfg.resolved(steps=steps_from_epochs(cfg, source), batch_size=batch_size)
    evals = as_eval_batches(
        inputs.eval_data, batch_size, seq_len=getattr(pipeline, "seq_len", 128), seed=cfg.seed, check=cfg.check_data
    )
    default_tx = inputs.optimizer is None  # AdamW with cosine decay, clipped at cfg.clip_norm
    tx = make_optimizer(1e-3, total_steps=cfg.steps, clip_norm=cfg.clip_norm) if default_tx else inputs.optimizer
    tx = with_ema(tx, cfg.ema)  # the weights' moving average rides in the optimizer state (jaxnn.loop._ema)
    mesh = _mesh(inputs.mesh, cfg)
    check_batch_divisible(batch_size, mesh)
    check_accumulate(cfg, mesh)
    decays = inputs.optimizer is None if inputs.schedule_decays is None else inputs.schedule_decays
    refuse_resume_with_other_steps(cfg, decays, default_optimizer=inputs.optimizer is None)
    if inputs.init_from is not None and (inputs.params is not None or inputs.model_state is not None):
        raise ConfigError("fit: init_from and params/model_state exclude each other")
    if inputs.resume_from is not None:
        inputs = _resuming(inputs)
    in_shape = example["x"].shape
    start_from = starting_point(model, in_shape, inputs.params, inputs.model_state)  # given params fit the model
    if inputs.lora is not None:  # the base becomes the given params with adapters; tx trains the adapters alone
        model, tx, inputs, lora_record = lora_start(model, tx, cfg, inputs, batch_spec(example)["x"])
        start_from = {**start_from, **lora_record}
    create = lambda: initial_state(model, tx, cfg, in_shape, inputs.params, inputs.model_state)  # noqa: E731
    abstract = jax.eval_shape(create)
    output = output_spec(model, cfg.precision, abstract, batch_spec(example))  # the probe
    aug = augmentation(inputs.augment, output)
    refuse_loss_ignoring_mixed_targets(inputs.loss, aug, output, example)
    base = {**cfg.record(), **({"steps": cfg.steps} if decays else {}), **(inputs.config or {})}
    files = RunFiles(cfg, json_record({**base, **({"augment": aug.record()} if aug else {})}), is_main=_main())
    files.precheck()  # a run dir in use is refused now, before anything is compiled
    trained_with = _optimizer_record(tx, abstract, cfg, decays)
    if inputs.check_optimizer:  # after the record's own comparison, whose message names the config's fields
        refuse_other_optimizer(cfg, inputs.resume_from, trained_with, default_optimizer=inputs.optimizer is None)
    state = create_sharded_state(create, mesh, inputs.sharding_rules, show_report=cfg.progress and _main())
    if inputs.init_from is not None:
        state, start_from = state_from(inputs.init_from, state)
    if inputs.resume_from is not None:
        state = load_training_state(inputs.resume_from, state)
    check_step_runs(model, inputs.loss, tx, cfg, state, example, source, aug, output)
    _say_if_devices_idle(mesh)
    check_eval_data(evals, example, inputs.loss, output)
    check_monitors(callbacks, cfg, evals, model, inputs.loss, state, scores)
    # The record: config.json's one serialisation, of which the precheck saw the part known then.
    files.record = {**files.record, **model_record(state.params), **start_from, FIELD: trained_with[FIELD]}
    evaluation = (evals, scores, Levers(cfg, model, abstract.params, data, inputs, trained_with[FIELD]))
    files.open()  # the run dir is checked and locked here; nothing was written before
    try:
        result, interrupted = _train(
            model, inputs.loss, tx, cfg, source, evaluation, mesh, state, files.record, files, callbacks, aug
        )
    finally:
        files.close()
    remember(result.state, trained_with)  # for save_model's record of this state
    if cfg.ema is not None:  # the average is what was evaluated, and what the caller gets (and saves)
        result = result._replace(state=with_ema_params(result.state))
    if interrupted:
        raise FitInterrupted(f"fit: interrupted (Ctrl-C) at step {result.summary['step']}; checkpoint saved", result)
    return result


def _resuming(inputs: FitInputs) -> FitInputs:
    """`inputs` starting from the parameters and model state of the saved model they resume (checked against the
    model like `params=`); its optimizer state, step and key join once the state exists."""
    given = [name for name in ("init_from", "params", "model_state", "lora") if getattr(inputs, name) is not None]
    if given:
        raise ConfigError(f"fit: resume= a saved model and {', '.join(given)} exclude each other")
    assert inputs.resume_from is not None
    _, params, model_state = load_model(inputs.resume_from)
    return inputs._replace(params=params, model_state=model_state or None)


def _optimizer_record(tx, abstract, cfg: FitConfig, decays: bool) -> dict:
    """What a resume of this run checks: the optimizer's fingerprint, and `steps` where the schedule ends there."""
    return {FIELD: fingerprint(tx, abstract.opt_state), **({"steps": cfg.steps} if decays else {})}


def _main() -> bool:
    return jax.process_index() == 0


def _rematerialised(model: Layer, policy: str) -> Layer:
    try:
        return rematerialised(model, policy)
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None


def _mesh(mesh: Mesh | MeshShape | None, cfg: FitConfig) -> Mesh:
    """fit's `mesh` as a Mesh: given, built from its shape, or `devices` local devices (all, with many processes)."""
    if isinstance(mesh, Mesh):
        built = mesh
    elif isinstance(mesh, MeshShape):
        built = make_mesh(mesh)
    else:
        built = make_mesh(None if jax.process_count() > 1 else checked_devices(cfg.devices))
    return built


def _say_if_devices_idle(mesh: Mesh) -> None:
    """A mesh that leaves some of the process's devices idle is said once, when the run goes ahead (after every
    refusal, so that a refused run's one line stays its only output)."""
    used, present = mesh.devices.size, jax.device_count()
    if used < present:
        _say_unused_devices(used, present, jax.devices()[0].platform)


@functools.cache
def _say_unused_devices(used: int, present: int, platform: str) -> None:
    warn_at_caller(
        f"fit trains on {used} of the {present} {platform} devices present; pass devices={present} (data "
        "parallel) or a mesh to use them",
        UnusedDevicesWarning,
    )


def _train(
    model, loss, tx, cfg, source, evaluation, mesh, state, record, files, callbacks, aug
) -> tuple[FitResult, bool]:
    evals, scores, levers = evaluation  # the evaluation batches, the whole-set metrics, the start-of-run block
    dp = data_parallel_train_step(
        model,
        loss,
        tx,
        cfg.precision,
        mesh=mesh,
        form=cfg.form,
        accumulate=cfg.accumulate,
        augment=augment_fn(aug),
    )
    ckpt = (
        Checkpointer(
            files.ckpt_dir,
            keep=cfg.keep,
            save_every=0 if cfg.keep_best else cfg.ckpt_every,  # keep_best saves at every evaluation instead
            async_save=cfg.async_checkpoints,
            ignore=(FIELD,),  # checked by the resume's own optimizer check (older checkpoints lack it)
            keep_best=cfg.keep_best,
            best_mode=metric_mode(cfg.keep_best, cfg.keep_best_mode) if cfg.keep_best else "min",
        )
        if files.ckpt_dir
        else None
    )
    state, start = _start(ckpt, state, record, source, cfg, files, tx)
    if start >= cfg.steps:
        return _already_finished(ckpt, state, start, files), False
    place = _placer(dp, mesh, cfg.batch_size)
    levers.announce(dp, state, place(source.example()))
    batches = DevicePrefetch(source.iterator(start, cfg.steps), place=place, size=cfg.prefetch)
    evaluate = _evaluator(model, loss, cfg, mesh, dp, evals, scores)
    run = RunInfo(cfg.steps, cfg.run_dir, files.is_main, start, start, state, get_policy(cfg.precision).loss_scaling)
    if cfg.guard_nonfinite and not any(isinstance(c, NonFiniteGuard) for c in callbacks):
        callbacks = [NonFiniteGuard(), *callbacks]
    if cfg.profile_dir:
        from jaxnn.profile.trace import TraceSteps

        callbacks = [*callbacks, TraceSteps(cfg.profile_dir)]
    tracker = Tracker(cfg, files, callbacks, run, cfg.batch_size)
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
    summary["input"], summary["levers"] = input_record(source), levers.record
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


def _evaluator(model, loss, cfg, mesh, dp, evals, scores=()):
    """`state -> metrics` over every evaluation example exactly once (see jaxnn.evaluation), compiled once."""
    if not evals:
        return None
    split = batch_devices(mesh)
    size = max(round_up(int(np.shape(b["x"])[0]), split) for b in evals)
    place = _placer(dp, mesh, size)
    sums = jax.jit(eval_sums_fn(model, loss, cfg.precision, scores))
    return lambda state: mean_over(
        lambda b: sums(ema_params(state), state.model_state, b), (place(padded(h, size)) for h in evals), scores
    )


def _start(ckpt, state, record, source, cfg, files, tx) -> tuple[Any, int]:
    """The state and step the run starts from: its newest checkpoint when resuming, else the given state's own
    step (a saved model's, with fit's `resume=`); a start whose learning rate is 0 for the rest is refused."""
    state, start = _restore(ckpt, state, record, source, cfg, files)
    where = str(files.ckpt_dir)
    if not start and local_value(state.step):
        start, where = int(local_value(state.step)), "the saved model"
    if start:
        try:
            refuse_idle_resume(tx, state, start, cfg.steps, where)
        except ConfigError:
            if ckpt:  # the refused run leaves its checkpoints as they were, with nothing in flight
                ckpt.close()
            raise
    return state, start


def _restore(ckpt, state, record, source, cfg, files) -> tuple[Any, int]:
    if not (cfg.resume and ckpt):
        return state, 0
    restored = ckpt.restore(state, record)
    if restored is None:
        if not local_value(state.step):  # else a saved model's state is where the run starts
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
