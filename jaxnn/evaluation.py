"""Exact evaluation and batched prediction: `jaxnn.evaluate(model, state, data)`, `jaxnn.predict(...)`.

Evaluation is exact for any loss, whether or not it reads a mask or returns a count: the model runs on whole
(padded) batches, then the loss runs once per example (`jax.vmap` over rows, each a batch of one), and the loop
sums those per-example values over the real rows only. A `count` the loss returns for an example (e.g. its real
tokens) weights that example. The one assumption is the usual one: the loss is a mean over the examples of a
batch (a loss that couples examples, e.g. a contrastive one, is evaluated per example). Every batch is padded
to one size, a multiple of the devices the batch is split over, so evaluation compiles once.

    metrics = jaxnn.evaluate(model, result.state, (x_test, y_test), batch_size=256)   # {"loss": ..., ...}
    jaxnn.evaluate(model, result.state, (x_test, y_test), metrics=["f1", "roc_auc"])  # exact over the whole set
    logits = jaxnn.predict(model, result.state, x_test)                              # (len(x_test), classes)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxnn.data.datasets import DataError, ImageDataset, TextCorpus
from jaxnn.data.sources import as_arrays, as_eval_batches
from jaxnn.layers.core import Layer
from jaxnn.precision import Policy, get_policy
from jaxnn.scores import get_scores
from jaxnn.train import Batch, LossFn, forward_batch, masked_classification_loss

VALID = "__valid__"  # the loop's own mark of a batch's real rows, taken out before the loss sees the batch


def eval_sums_fn(model: Layer, loss_fn: LossFn, policy: Policy | str = "fp32", scores: Sequence[Any] = ()) -> Callable:
    """`(params, model_state, batch) -> (sums, weight, states)`: per-example metrics summed over the batch's real
    rows, and each of `scores`' sums (`jaxnn.scores`) over the same rows.

    `batch[VALID]` (1 real, 0 padding) marks the rows; metrics divided by the summed weight are exact means.
    """
    policy = get_policy(policy)

    def sums(params: Any, model_state: Any, batch: Batch) -> tuple[dict, jax.Array, dict]:
        batch = dict(batch)
        valid = batch.pop(VALID).astype(jnp.float32)
        logits, _ = forward_batch(model, policy, params, model_state, batch, key=None, train=False)
        per = jax.vmap(lambda out, row: _one_example(loss_fn, out, row))(logits, batch)
        weight = valid * per.pop("count") if "count" in per else valid
        total = {k: jnp.sum(jnp.where(weight > 0, v, 0.0) * weight) for k, v in per.items() if v.ndim == 1}
        states = {score.name: score.sums(logits, batch, valid) for score in scores}
        return total, jnp.sum(weight), states

    return sums


def _one_example(loss_fn: LossFn, out: Any, row: Batch) -> dict:
    one = lambda a: a[None]  # noqa: E731 - each example as a batch of one
    loss, metrics = loss_fn(jax.tree.map(one, out), jax.tree.map(one, row))
    return {k: jnp.asarray(v, jnp.float32) for k, v in {**metrics, "loss": loss}.items()}


def metric_names(
    model: Layer, loss_fn: LossFn, policy: Any, params: Any, model_state: Any, example: Batch, scores: Sequence = ()
) -> list:
    """The metric names evaluation reports, from `jax.eval_shape` of the eval computation (nothing runs; a score
    that cannot read this model's outputs is refused here, in one line)."""
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), dict(example))
    spec[VALID] = jax.ShapeDtypeStruct((int(np.shape(example["x"])[0]),), np.float32)
    sums, _, states = jax.eval_shape(eval_sums_fn(model, loss_fn, policy, scores), params, model_state, spec)
    return sorted({*sums, *states})


def padded(batch: Batch, size: int) -> Batch:
    """`batch` padded to `size` rows (copies of row 0), with `VALID` marking its real rows (or its own 1-D mask)."""
    n = int(np.shape(batch["x"])[0])
    mask = batch.get("mask")
    valid = np.asarray(mask, np.float32) if mask is not None and np.ndim(mask) == 1 else np.ones(n, np.float32)
    if n > size:
        raise DataError(f"eval_data: a batch of {n} rows is larger than the evaluation batch size {size}")
    idx = np.concatenate([np.arange(n), np.zeros(size - n, int)])
    out = {k: np.asarray(v)[idx] for k, v in batch.items()}
    out[VALID] = np.concatenate([valid, np.zeros(size - n, np.float32)])
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def mean_over(step: Callable, batches: Iterable[Batch], scores: Sequence[Any] = ()) -> dict[str, Any]:
    """Means over all real rows of `batches`, each already placed, and `scores`' values from their summed states;
    `step` returns (sums, weight, states)."""
    totals: dict[str, float] = {}
    weight = 0.0
    states: Any = None
    for batch in batches:
        sums, w, batch_states = jax.device_get(step(batch))
        weight += float(w)
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        batch_states = jax.tree.map(lambda a: np.asarray(a, np.float64), batch_states)
        states = batch_states if states is None else jax.tree.map(np.add, states, batch_states)
    if not weight:
        return {}
    means: dict[str, Any] = {k: v / weight for k, v in totals.items() if k != "count"}
    return {**means, **{score.name: score.value(states[score.name]) for score in scores}}


# ------------------------------------------------------------------------------------------------ public API


def params_and_state(params_or_state: Any, model_state: Any) -> tuple[Any, Any]:
    """(params, model_state) from a TrainState, FitResult, LoadedParams, or a bare parameter tree; without the fp8
    amax histories a delayed-scaling run trains with (they are training state, not the model)."""
    from jaxnn.fp8 import without_histories

    source = getattr(params_or_state, "state", params_or_state)  # a FitResult
    if hasattr(source, "params"):
        state = getattr(source, "model_state", {}) if model_state is None else model_state
        return without_histories(source.params), state
    return without_histories(params_or_state), {} if model_state is None else model_state


def _mesh_for(mesh: Mesh | str | None, devices: int) -> Mesh:
    from jaxnn.parallel.mesh import make_mesh

    if isinstance(mesh, str):
        from jaxnn.parallel.mesh import make_mesh

        return make_mesh(mesh)
    return mesh if mesh is not None else make_mesh(devices)


def _placement(mesh: Mesh) -> tuple[Callable[[Any], Any], int]:
    from jaxnn.parallel.mesh import batch_devices
    from jaxnn.parallel.placement import shard_batch

    return (lambda host: shard_batch(host, mesh)), batch_devices(mesh)


def evaluate(
    model: Layer,
    params_or_state: Any,
    data: Any,
    *,
    loss: LossFn = masked_classification_loss,
    model_state: Any = None,
    batch_size: int = 64,
    precision: str = "fp32",
    mesh: Mesh | str | None = None,
    devices: int = 1,
    seed: int = 0,
    seq_len: int = 128,
    metrics: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Metrics of `loss` over every example of `data`, each counted once (see the module docstring), and the
    `metrics` asked for (names or `jaxnn.scores.Score`s: "f1", "precision", "recall", "roc_auc",
    "confusion_matrix", "perplexity", "mae", ...), each computed once from sums over the whole data, not averaged
    over batches.

    params_or_state: a `TrainState` (e.g. `fit(...).state`), a `FitResult`, `jaxnn.checkpoint.load_params`'s
      result, or a parameter tree (with `model_state=` for stateful models).
    data: any form `jaxnn.fit` takes as `eval_data`: `(x, y)`, a dict of arrays, a jaxnn data set (its test
      split), or an iterable of batch dicts. `batch_size` is rounded up to a multiple of the batch's devices.
    mesh / devices: as in `jaxnn.fit`; the parameters are replicated over the mesh.
    """
    from jaxnn.parallel.placement import replicate

    _check_batch_size("evaluate", batch_size)
    scores = get_scores(metrics, "evaluate")
    params, state = params_and_state(params_or_state, model_state)
    mesh = _mesh_for(mesh, devices)
    place, split = _placement(mesh)
    size = round_up(batch_size, split)
    batches = as_eval_batches(data, size, seq_len=seq_len, seed=seed) or []
    if not batches:
        raise DataError("evaluate: the data hold no examples (an empty iterable, array or split); nothing to evaluate")
    if _takes_class_indices(loss):
        check_label_range(model, params, state, batches, precision)
    size = max([size, *(round_up(int(np.shape(b["x"])[0]), split) for b in batches)])
    params, state = replicate((params, state), mesh)
    sums = jax.jit(eval_sums_fn(model, loss, precision, scores))
    return mean_over(lambda b: sums(params, state, b), (place(padded(b, size)) for b in batches), scores)


def _takes_class_indices(loss: Any) -> bool:
    """Whether `loss` is one of jaxnn's losses over integer class (or token) indices, `functools.partial`s of them
    included; a user's loss may read `y` any way it likes."""
    from jaxnn.train import classification_loss, language_model_loss, lm_loss

    while isinstance(loss, functools.partial):
        loss = loss.func
    return loss in (masked_classification_loss, classification_loss, lm_loss, language_model_loss)


def check_label_range(model: Layer, params: Any, state: Any, batches: list, precision: Any = "fp32") -> None:
    """Integer labels `y` shaped like the model's output without its last axis must index that axis: a label
    outside the model's classes (or vocabulary) is one DataError, not a NaN loss and an accuracy of 0."""
    first = batches[0]
    if "y" not in first or np.asarray(first["y"]).dtype.kind not in "iuf":
        return
    spec = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in first.items() if k != VALID}
    policy = get_policy(precision)
    out = jax.eval_shape(lambda p, s, b: forward_batch(model, policy, p, s, b, key=None, train=False)[0],
                         params, state, spec)  # fmt: skip
    if not hasattr(out, "shape") or tuple(out.shape[:-1]) != tuple(np.shape(first["y"])):
        return  # not one class index per output row: the loss decides what `y` means
    if np.asarray(first["y"]).dtype.kind == "f":
        raise DataError(
            f"evaluate: labels 'y' are {np.asarray(first['y']).dtype}, one per output row like class indices; "
            "classification losses take integer classes (cast them, e.g. y.astype(int))"
        )
    classes = int(out.shape[-1])
    real = [np.asarray(b["y"])[np.asarray(b["mask"]) > 0] if "mask" in b else np.asarray(b["y"]) for b in batches]
    labels = np.concatenate([r.ravel() for r in real])
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(
            f"evaluate: labels 'y' run from {labels.min()} to {labels.max()}, outside the model's {classes} "
            f"outputs (0..{classes - 1})"
        )


def _check_batch_size(caller: str, batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"{caller}: batch_size must be a positive integer, got {batch_size!r}")


def _as_array(data: list) -> np.ndarray:
    try:
        return np.asarray(data)
    except ValueError as err:  # ragged rows
        raise DataError(f"predict: a list of examples must stack into one array ({err})") from None


def _inputs(data: Any, batch_size: int) -> Iterator[Any]:
    """Model inputs `x` of `data` in order, in batches of at most `batch_size` rows."""
    if isinstance(data, (ImageDataset, TextCorpus)):
        yield from (b["x"] for b in as_eval_batches(data, batch_size) or [])
        return
    if hasattr(data, "shape"):
        data = {"x": data}
    arrays = as_arrays(data, "data")
    if arrays is not None:
        x = arrays["x"]
        yield from (x[lo : lo + batch_size] for lo in range(0, len(x), batch_size))
        return
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise DataError(f"data: expected an array, arrays, a data set or batches, got {type(data).__name__}")
    yield from (np.asarray(b["x"]) for b in data)


def predict(
    model: Layer,
    params_or_state: Any,
    data: Any,
    *,
    model_state: Any = None,
    batch_size: int = 64,
    precision: str = "fp32",
    mesh: Mesh | str | None = None,
    devices: int = 1,
    probabilities: bool = False,
) -> Any:
    """The model's outputs (eval mode) for every example of `data`, in order, as numpy arrays with one row each.

    probabilities: the outputs as class probabilities (float32): a softmax over the last axis, or a sigmoid where
    it has one unit (a binary classifier's one logit). For a model whose output is one array of logits.

    data: an input array `x` or anything numpy reads as one (a list of examples, a nested list), `(x, y)`, a dict
    of arrays with "x", a jaxnn data set (its test split, padding rows dropped) or an iterable of batch dicts.
    Batched by `batch_size`; the last partial batch is padded for the compiled program and the padding cut off,
    so it compiles once.
    """
    from jaxnn.parallel.placement import replicate, shard_batch

    _check_batch_size("predict", batch_size)
    if isinstance(data, list) and not (data and isinstance(data[0], dict)):
        data = _as_array(data)  # a list of examples, not of batch dicts
    params, state = params_and_state(params_or_state, model_state)
    mesh = _mesh_for(mesh, devices)
    _, split = _placement(mesh)
    policy = get_policy(precision)
    forward: Callable = jax.jit(lambda p, s, x: forward_batch(model, policy, p, s, {"x": x}, key=None, train=False)[0])
    if probabilities:
        forward = _as_probabilities(forward)
    if isinstance(data, np.ndarray):
        _check_batch_axis(forward, params, state, data)
    params, state = replicate((params, state), mesh)
    outputs = []
    for x in _inputs(data, batch_size):
        n = int(np.shape(x)[0])
        host = padded({"x": x}, round_up(max(n, batch_size), split))
        out = forward(params, state, shard_batch({"x": host["x"]}, mesh)["x"])
        outputs.append(jax.tree.map(lambda a, n=n: np.asarray(a)[:n], jax.device_get(out)))
    if not outputs:
        raise DataError("predict: the data hold no examples (an empty iterable); nothing to predict")
    if isinstance(data, ImageDataset):
        total = len(data.x_test)
        return jax.tree.map(lambda *parts: np.concatenate(parts)[:total], *outputs)
    return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)


def _as_probabilities(forward: Callable) -> Callable:
    """`forward`, whose output is logits, giving probabilities: softmax over the last axis, sigmoid for one unit."""

    def probabilities(*args):
        logits = forward(*args)
        if not hasattr(logits, "shape") or logits.ndim < 1:
            raise ValueError(
                f"predict: probabilities=True needs a model whose output is one array of logits, got "
                f"{type(logits).__name__}"
            )
        logits = logits.astype(jnp.float32)
        return jax.nn.sigmoid(logits) if logits.shape[-1] == 1 else jax.nn.softmax(logits, axis=-1)

    return jax.jit(probabilities)


def _check_batch_axis(forward: Callable, params: Any, state: Any, x: np.ndarray) -> None:
    """Refuses one example given without its batch axis, which the model would otherwise read as a batch of
    smaller examples and fail on a weight's shape: the model takes `x[None]` but not `x`'s rows."""

    def takes(shape: tuple[int, ...]) -> bool:
        try:
            jax.eval_shape(forward, params, state, jax.ShapeDtypeStruct(shape, x.dtype))
        except Exception:  # noqa: BLE001 - any refusal of the shape by the model's layers
            return False
        return True

    one_row = (1, *x.shape[1:])
    if x.ndim >= 1 and not takes(one_row) and takes((1, *x.shape)):
        raise DataError(
            f"predict: x has shape {x.shape}: one example without its batch axis (the model takes "
            f"{(1, *x.shape)}, not rows of {x.shape[1:]}); pass x[None]"
        )


__all__ = ["evaluate", "params_and_state", "predict"]
