"""The loop's setup checks: everything `fit` refuses before anything is compiled or written, each in one line
naming the culprit (a bad device count, data, model/loss pair, evaluation set, monitored metric, starting point),
and the shape probes they share. Internal to `jaxnn.loop`.

The model's output is probed once (`output_spec`, from the abstract train state: no FLOPs) and handed to every
check that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import pathlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxnn.augment import Augment, augment_batch, parse_augment
from jaxnn.callbacks import Callback, EarlyStopping, metric_mode
from jaxnn.checkpoint import load_train_state, state_digest
from jaxnn.config import ConfigError, FitConfig, config_differences, first_differences
from jaxnn.data.datasets import DataError, ImageDataset
from jaxnn.evaluation import metric_names
from jaxnn.layers.core import Layer
from jaxnn.parallel.mesh import batch_devices
from jaxnn.precision import get_policy
from jaxnn.scores import get_scores
from jaxnn.train import (
    classification_loss,
    create_train_state,
    forward_batch,
    masked_classification_loss,
    train_step_fn,
)

log = logging.getLogger("jaxnn.loop")


def checked_devices(n: int) -> int:
    if n > jax.local_device_count():
        hint = (
            f"; call jaxnn.parallel.configure_cpu_devices({n}) before jax starts, or run `jaxnn train --devices {n}`"
            if jax.default_backend() == "cpu"
            else ""
        )
        raise ConfigError(f"devices {n}: only {jax.local_device_count()} {jax.default_backend()} devices here{hint}")
    return n


def batch_size_of(batch: dict) -> int:
    if not isinstance(batch, dict) or "x" not in batch:
        raise ConfigError(
            f"data: batches must be dicts with an input 'x' (and targets, e.g. 'y'), got "
            f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, dict) else ''}"
        )
    return int(np.shape(batch["x"])[0])


def starting_point(model: Layer, in_shape: Any, params: Any, model_state: Any) -> dict:
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


def lora_start(model: Layer, tx: Any, cfg: FitConfig, inputs: Any, x_spec: Any) -> tuple[Layer, Any, Any, dict]:
    """fit's `lora`: the starting params (given, `init_from`'s, or the model's initialisation) with adapters
    added, an optimizer that trains them alone, the model with adapter dropout, and the record's entries.
    Adapters that the model would never read (a pattern matching a convolution's or a custom layer's weight)
    are refused, naming them."""
    from jaxnn import lora as lora_lib
    from jaxnn.checkpoint import load_params
    from jaxnn.layers.core import init_model, run

    try:
        settings = lora_lib.as_lora(inputs.lora)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: {err}") from None
    params, model_state, record = inputs.params, inputs.model_state, {"lora": settings.record()}
    if inputs.init_from is not None:  # another run's parameters: the base, under new adapters and a new optimizer
        loaded = load_params(inputs.init_from)  # a LoRA run's adapters are folded in: the new ones start afresh
        params, model_state = lora_lib.merge(loaded.params), loaded.model_state or None
        record.update(starting_point(model, x_spec.shape, params, model_state))
        record["init_from"] = record.pop("initial_params")
    if params is None or (model.stateful and model_state is None):
        _, fresh, fresh_state = init_model(model, jax.random.key(cfg.seed), x_spec.shape)
        params = fresh if params is None else params
        model_state = fresh_state if model_state is None else model_state
    try:
        params = lora_lib.add_adapters(params, settings, jax.random.fold_in(jax.random.key(cfg.seed), 0x10AA))
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    unused = lora_lib.unused_adapters(lambda p, x: run(model, p, x, state=model_state)[0], params, x_spec)
    if unused:
        raise ConfigError(
            f"fit: LoRA targets {unused[0]}{f' and {len(unused) - 1} more' if len(unused) > 1 else ''}, which no "
            "Dense layer multiplies (a convolution's or a custom layer's weight): its adapters would never train; "
            "narrow the targets"
        )
    model = lora_lib.lora_model(model, settings)
    sizes = {name: int(np.size(leaf)) for name, leaf in lora_lib.adapters(params).items()}
    trained = sum(n for name, n in sizes.items() if not name.endswith("lora_scale"))
    total = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params)) - sum(sizes.values())
    try:
        params = lora_lib.quantize_base(params, settings)  # counted above as weights, stored from here as codes
    except ValueError as err:
        raise ConfigError(f"fit: {err}") from None
    log.info("fit: LoRA r=%d on %d weights: %s trainable parameters beside %s frozen (%.2f%%)", settings.rank,
             len(sizes) // 3, f"{trained:,}", f"{total:,}", 100 * trained / max(total, 1))  # fmt: skip
    inputs = inputs._replace(params=params, model_state=model_state, init_from=None)
    return model, lora_lib.train_adapters_only(tx), inputs, record


def initial_state(model: Layer, tx: Any, cfg: FitConfig, in_shape: Any, params: Any, model_state: Any) -> Any:
    state = create_train_state(model, tx, jax.random.key(cfg.seed), in_shape, cfg.precision)
    if params is not None:
        params = get_policy(cfg.precision).cast_to_param(params)
        state = state._replace(params=params, opt_state=tx.init(params))
    if model_state is not None:
        state = state._replace(model_state=model_state)
    return state


def augmentation(augment, output: Any) -> Any:
    """fit's `augment` as an `Augment` with the model's classes (from its probed `output`) filled in, or None; bad
    settings are one line."""
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
        if output is None or not hasattr(output, "shape"):
            raise ConfigError("fit: mixup and cutmix need Augment(num_classes=...); the model's output gives none")
        aug = dataclasses.replace(aug, num_classes=int(output.shape[-1]))
    return aug


def augment_fn(aug) -> Any:
    if aug is None:
        return None
    return functools.partial(augment_batch, aug)


def refuse_loss_ignoring_mixed_targets(loss, aug, output, example: dict) -> None:
    """Mixup and cutmix mix the images and hand the loss the mixed targets as `y_soft`; a loss that never reads
    them would train mixed images against one image's label. Found from the loss's traced program."""
    if aug is None or not aug.mixes or output is None or not hasattr(output, "shape"):
        return
    import jax.numpy as jnp

    from jaxnn._src.jaxpr import used_inputs

    batch = {**batch_spec(example), "y_soft": jax.ShapeDtypeStruct((output.shape[0], aug.num_classes), jnp.float32)}
    try:
        jaxpr = jax.make_jaxpr(lambda out, b: loss(out, b))(output, batch).jaxpr
    except Exception:  # noqa: BLE001 - a loss that cannot run is named by the step's own check next
        return
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((output, batch))[0]]
    soft = next(i for i, path in enumerate(paths) if "'y_soft'" in path)
    if soft not in used_inputs(jaxpr):
        name = getattr(loss, "__name__", type(loss).__name__)
        raise ConfigError(
            f"fit: augment mixes targets (mixup/cutmix), but the loss {name} never reads batch['y_soft'], the mixed "
            "targets: it would train mixed images against one image's label; use "
            "jaxnn.train.masked_classification_loss or read y_soft"
        )


def check_step_runs(model, loss, tx, cfg, state, example, source, aug, logits) -> None:
    """Traces the step on the batch's shapes (no compile, no FLOPs) so a model/loss/data mismatch is one line;
    `logits` is the model's probed output (None where the model cannot run: the trace then names the failure)."""
    batch = batch_spec(example)
    shapes = {k: f"{v.dtype}{list(v.shape)}" for k, v in batch.items()}
    if logits is not None:
        if is_classification(loss):
            check_labels(logits, example, all_labels(source, example), shapes)
        check_loss_output(loss, logits, batch)
    try:
        step = train_step_fn(model, loss, tx, cfg.precision, accumulate=cfg.accumulate, augment=augment_fn(aug))
        jax.eval_shape(step, state, batch)
    except Exception as err:  # noqa: BLE001 - any failure here is the model, the loss or the data
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the model and loss cannot run on a batch {shapes}: {type(err).__name__}: {reason[:300]}"
        ) from err


def batch_spec(batch: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}


def output_spec(model, precision, state, batch) -> Any:
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


def is_classification(loss) -> bool:
    while isinstance(loss, functools.partial):
        loss = loss.func
    return loss in (masked_classification_loss, classification_loss)


def all_labels(source, example: dict) -> Any:
    """Every training label where they are at hand (arrays, an image data set), else the first batch's."""
    arrays = getattr(getattr(source, "_batches", None), "arrays", None)
    if arrays is not None and "y" in arrays:
        return arrays["y"]
    data = getattr(source, "data", None)
    return data.y_train if isinstance(data, ImageDataset) else example.get("y")


def check_labels(logits, example: dict, labels: Any, shapes: dict, role: str = "data") -> None:
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


def check_loss_output(loss, logits, batch) -> None:
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


def check_eval_data(evals, example, loss, output) -> None:
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
    if is_classification(loss) and "y" in first:
        classes = getattr(output, "shape", (None,))[-1]
        labels = np.concatenate([np.asarray(b["y"]).ravel() for b in evals])
        if classes is not None and (labels.min() < 0 or labels.max() >= classes):
            raise DataError(
                f"eval_data: labels 'y' run from {labels.min()} to {labels.max()}, outside the model's "
                f"{classes} classes (0..{classes - 1})"
            )


def fit_scores(eval_metrics: Any) -> tuple:
    """fit's `eval_metrics`, checked: known names or metric objects, each one number (the confusion matrix is
    `jaxnn.evaluate`'s alone: a matrix is no history to plot or watch)."""
    scores = get_scores(eval_metrics, "fit: eval_metrics")
    for score in scores:
        if not getattr(score, "scalar", True):
            raise ConfigError(f"fit: eval_metrics: {score.name!r} is not one number; use jaxnn.evaluate for it")
    return scores


def check_monitors(callbacks, cfg, evals, model, loss, state, scores=()) -> None:
    """Every evaluation metric a callback or keep_best watches exists, and there is evaluation data to watch;
    every metric of `scores` reads this model's outputs (refused in one line before training otherwise)."""
    if scores and not evals:
        raise ConfigError(f"fit: eval_metrics {[s.name for s in scores]} need eval_data")
    if scores:
        metric_names(model, loss, cfg.precision, state.params, state.model_state, evals[0], scores)
    watched = [(type(c).__name__, m) for c in callbacks for m in c.monitors()]
    watched += [("keep_best", cfg.keep_best)] if cfg.keep_best else []
    if not watched:
        return
    if not evals:
        who, metric = watched[0]
        raise ConfigError(f"{who} monitors the evaluation metric {metric!r}, but fit has no eval_data")
    names = metric_names(model, loss, cfg.precision, state.params, state.model_state, evals[0], scores)
    for who, metric in watched:
        if metric not in names:
            raise ConfigError(f"{who} monitors {metric!r}, but the evaluation reports {names}")
    modes = [(type(c).__name__, c.metric, c.requested_mode) for c in callbacks if isinstance(c, EarlyStopping)]
    modes += [("keep_best", cfg.keep_best, cfg.keep_best_mode)] if cfg.keep_best else []
    for who, metric, mode in modes:
        try:
            metric_mode(metric, mode)
        except ValueError as err:
            raise ConfigError(f"{who}: {err}") from None


def checked_callbacks(callbacks) -> list[Callback]:
    """fit's `callbacks` as a list: one Callback given alone is taken as a list of one; anything else that is
    not a list of Callback instances is one ConfigError naming it."""
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    if isinstance(callbacks, (str, bytes, dict)) or not hasattr(callbacks, "__iter__"):
        raise ConfigError(f"callbacks must be a list of jaxnn.callbacks.Callback, got {type(callbacks).__name__}")
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


def steps_from_epochs(cfg: FitConfig, source) -> int:
    """The run's step count: `steps`, or `epochs` times the data's batches per pass."""
    if cfg.epochs is None:
        return cfg.steps
    per_epoch = source.steps_per_epoch()
    if per_epoch is None:
        raise ConfigError("fit: epochs needs data of known length (arrays, a data set, a list); pass steps instead")
    return cfg.epochs * per_epoch


def check_accumulate(cfg: FitConfig, mesh: Mesh) -> None:
    n, rows = batch_devices(mesh), (cfg.batch_size or 0) // cfg.accumulate
    if cfg.accumulate > 1 and rows % n:
        raise ConfigError(
            f"fit: accumulate {cfg.accumulate} makes micro-batches of {rows} rows, which the {n} devices of "
            "the batch cannot split evenly"
        )


def refuse_resume_with_other_steps(cfg: FitConfig, decays: bool, default_optimizer: bool) -> None:
    """A resume with other `steps` than the run was made for, where the learning rate schedule decays to 0 at
    `steps`: it would not continue the run it resumes. One line says so and how to go on (the record comparison
    alone would only name the field); the one place jaxnn checks it, for `fit` and `jaxnn train` alike."""
    if not (cfg.resume and decays and cfg.run_dir):
        return
    path = pathlib.Path(cfg.run_dir) / "config.json"
    try:
        saved = json.loads(path.read_text()).get("steps") if path.is_file() else None
    except Exception:  # noqa: BLE001 - a damaged config.json is reported by the run directory's own checks
        return
    if not isinstance(saved, int) or saved == cfg.steps:
        return
    if default_optimizer:
        raise ConfigError(
            f"fit: resume with steps {cfg.steps}, but the run in {cfg.run_dir} was made for {saved}, and the "
            f"default optimizer's learning rate decays to 0 at `steps`; pass optimizer= with a schedule that does "
            f"not depend on steps (e.g. optax.adam(1e-3)) from the start, or resume with steps={saved}"
        )
    raise ConfigError(
        f"--steps {cfg.steps}: the run in {cfg.run_dir} was made for {saved} steps with the cosine schedule, whose "
        f"learning rate decays to 0 at step {saved}; resume with --steps {saved}, or train with --schedule constant "
        "from the start to be able to train on"
    )


def state_from(path, state) -> tuple[Any, dict]:
    """Another run's whole train state as this run's starting point, at step 0 with this run's key."""
    restored, step = load_train_state(path, state)
    restored = restored._replace(step=restored.step - restored.step, key=state.key)
    digest = state_digest((restored.params, restored.model_state, restored.opt_state))[:16]
    log.info("fit: starting from the state of %s (its step %d)", path, step)
    return restored, {"init_from": digest}


def json_record(record: dict) -> dict:
    """`record` as it reads back from JSON (tuples become lists), so a saved copy compares equal to it."""
    try:
        return json.loads(json.dumps(record))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: config must hold JSON values (numbers, strings, lists, dicts): {err}") from None


def model_record(params) -> dict:
    """The parameter count and a digest of the parameter shapes: a resume into another model is refused early."""
    shapes = jax.tree_util.tree_flatten_with_path(params)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in shapes)
    return {
        "num_params": int(sum(np.prod(x.shape) for _, x in shapes)),
        "param_shapes": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def refuse_idle_resume(tx: Any, state: Any, start: int, steps: int, where: str) -> None:
    """A resumed run whose optimizer's learning rate is 0 from its first step on (a decaying schedule made for
    fewer steps than it is resumed with) would run its steps and change nothing: refused in one line, whatever
    optimizer made it. The probe is one update of the restored optimizer state for an all-ones gradient: any
    optimizer with a learning rate above 0 moves some parameter."""
    if start >= steps:
        return
    import optax

    extra = {"value": np.float32(0)} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}

    def moves(params, opt_state):
        updates, _ = tx.update(jax.tree.map(lambda p: p * 0 + 1, params), opt_state, params, **extra)
        moved = [jax.numpy.any(u != 0) for u in jax.tree.leaves(updates)]
        return jax.numpy.any(jax.numpy.stack(moved)) if moved else jax.numpy.asarray(True)

    # Compiled, so that sharded (and, with many processes, not fully addressable) states give one replicated flag.
    if local_value(jax.jit(moves)(state.params, state.opt_state)):
        return
    raise ConfigError(
        f"fit: the run resumed from {where} at step {start} would train to step {steps} with a learning rate of 0 "
        "(its optimizer changes no parameter from this step on: a schedule that ended at an earlier step); "
        "start a new run from its parameters with a new optimizer (params= and model_state= of "
        "jaxnn.checkpoint.load_params or jaxnn.load_model)"
    )


def local_value(x: Any) -> Any:
    """A replicated scalar's value on this process (a global array of many processes is not fully addressable)."""
    return np.asarray(x.addressable_data(0)).item() if isinstance(x, jax.Array) else np.asarray(x).item()


def input_record(source: Any) -> dict | None:
    """One example's input as the summary records it (what `jaxnn.save_model` keeps for exports and `jaxnn
    predict`): shape without the batch axis and dtype, and for a jaxnn image data set the normalisation its
    pipeline applied to the stored images; None for an input that is not one array (a tuple of them)."""
    x = source.example()["x"]
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return None
    record: dict[str, Any] = {"shape": [int(d) for d in x.shape[1:]], "dtype": np.dtype(x.dtype).name}
    data = getattr(source, "data", None)
    if isinstance(data, ImageDataset):
        record["normalise"] = {
            "stored_dtype": np.dtype(data.x_train.dtype).name,
            "scale": float(data.scale),
            "mean": [float(m) for m in np.ravel(data.mean)],
            "std": [float(v) for v in np.ravel(data.std)],
        }
    return record
