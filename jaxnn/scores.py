"""Evaluation metrics that are exact over a whole data set: each keeps sums (a state) that batches, devices and
processes add up, and computes its value once, from the totals, at the end.

An F1 averaged over batches is not the F1 of the data set (nor is a precision, an AUC or a perplexity); the sums
behind them are additive, so `jaxnn.evaluate(..., metrics=["f1"])` adds each batch's confusion counts and divides
once, as torchmetrics, Keras and CLU do.

    jaxnn.evaluate(model, state, (x, y), metrics=["accuracy", "f1", "roc_auc", "confusion_matrix"])
    jaxnn.fit(..., eval_data=(xv, yv), eval_metrics=["f1"], keep_best="f1")

A metric is a `Score`: `sums(logits, batch, weight)` (jittable; `weight` (rows,) is 1 for real rows and 0 for
padding) returns a dict of arrays to add up; `value(totals)` turns the totals (numpy) into a number (or, for the
confusion matrix, a nested list). Any object with `name`, `sums` and `value` works as a user's own metric.

Classification metrics read logits (..., C) and integer labels `y` (...): one row per example, or one per token
for a language model (positions weighted by `loss_mask` when the batch has one). Averages follow scikit-learn:
"macro" is the unweighted mean over the classes that occur in the labels or the predictions, "micro" pools every
decision (for single-label data it equals accuracy), and a class with no predictions scores 0. `roc_auc` bins the
scores (`bins` equal bins of the probability, default 1000; binary: the positive class's; more classes: the macro
one-vs-rest mean), so it is within about 1/bins of the exact value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn.errors import ConfigError

Sums = dict[str, jax.Array]


class Score(NamedTuple):
    """A metric as additive sums and a value computed from their totals."""

    name: str
    sums: Callable[[jax.Array, dict, jax.Array], Sums]
    value: Callable[[dict[str, np.ndarray]], Any]
    scalar: bool = True  # False: a value that is not one number (the confusion matrix), for evaluate only


# ------------------------------------------------------------------------------------------- what batches give


def _classes(name: str, logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array, int]:
    """(logits (rows, C), labels (rows,), C), refusing outputs that are not class scores."""
    y = batch.get("y")
    if y is None or not jnp.issubdtype(jnp.asarray(y).dtype, jnp.integer):
        raise ConfigError(f"metric {name!r}: needs integer class labels 'y'; this data's labels are not integers")
    if logits.ndim < 2 or logits.shape[-1] < 2 or logits.shape[:-1] != y.shape:
        raise ConfigError(
            f"metric {name!r}: needs class scores (..., classes >= 2) for labels {tuple(y.shape)}; the model "
            f"gives {tuple(logits.shape)}"
        )
    C = logits.shape[-1]
    return logits.reshape(-1, C).astype(jnp.float32), y.reshape(-1), C


def _weights(batch: dict, weight: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Each position's weight: its row's (real 1, padding 0), times `loss_mask` where the batch has one."""
    w = jnp.broadcast_to(weight.reshape(weight.shape + (1,) * (len(shape) - 1)), shape).astype(jnp.float32)
    if "loss_mask" in batch and batch["loss_mask"].shape == shape:
        w = w * batch["loss_mask"].astype(jnp.float32)
    return w.reshape(-1)


def _confusion_sums(name: str) -> Callable[[jax.Array, dict, jax.Array], Sums]:
    def sums(logits: jax.Array, batch: dict, weight: jax.Array) -> Sums:
        scores, y, C = _classes(name, logits, batch)
        w = _weights(batch, weight, batch["y"].shape)
        truth, guess = jax.nn.one_hot(y, C) * w[:, None], jax.nn.one_hot(jnp.argmax(scores, -1), C)
        return {"confusion": truth.T @ guess}  # [true class, predicted class]

    return sums


# ---------------------------------------------------------------------------------------- values from totals


def _per_class(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(true positives, predicted, actual, present) per class."""
    tp = np.diag(confusion)
    predicted, actual = confusion.sum(0), confusion.sum(1)
    return tp, predicted, actual, (predicted + actual) > 0


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b > 0)


def _averaged(kind: str, average: str) -> Callable[[dict], float]:
    def value(totals: dict) -> float:
        tp, predicted, actual, present = _per_class(np.asarray(totals["confusion"], np.float64))
        if average == "micro":
            tp, predicted, actual = tp.sum(keepdims=True), predicted.sum(keepdims=True), actual.sum(keepdims=True)
            present = np.ones(1, bool)
        precision, recall = _ratio(tp, predicted), _ratio(tp, actual)
        per = {"precision": precision, "recall": recall, "f1": _ratio(2 * tp, predicted + actual)}[kind]
        return float(per[present].mean()) if present.any() else 0.0

    return value


def _top_k_sums(k: int) -> Callable[[jax.Array, dict, jax.Array], Sums]:
    def sums(logits: jax.Array, batch: dict, weight: jax.Array) -> Sums:
        scores, y, C = _classes(f"top{k}_accuracy", logits, batch)
        w = _weights(batch, weight, batch["y"].shape)
        kth = jax.lax.top_k(scores, min(k, C))[0][:, -1]
        hit = jnp.take_along_axis(scores, y[:, None], axis=-1)[:, 0] >= kth
        return {"hits": jnp.sum(hit * w), "rows": jnp.sum(w)}

    return sums


def _auc_sums(bins: int) -> Callable[[jax.Array, dict, jax.Array], Sums]:
    def sums(logits: jax.Array, batch: dict, weight: jax.Array) -> Sums:
        scores, y, C = _classes("roc_auc", logits, batch)
        w = _weights(batch, weight, batch["y"].shape)
        probs = jax.nn.softmax(scores, axis=-1)
        bin_of = jnp.clip((probs * bins).astype(jnp.int32), 0, bins - 1)  # (rows, C)
        positive = jax.nn.one_hot(y, C)  # (rows, C): is the row of class c
        counts = jax.nn.one_hot(bin_of, bins) * w[:, None, None]  # (rows, C, bins)
        return {"positive": jnp.einsum("rc,rcb->cb", positive, counts),
                "negative": jnp.einsum("rc,rcb->cb", 1 - positive, counts)}  # fmt: skip

    return sums


def _auc_value(totals: dict) -> float:
    positive, negative = np.asarray(totals["positive"], np.float64), np.asarray(totals["negative"], np.float64)
    classes = [1] if positive.shape[0] == 2 else range(positive.shape[0])  # binary: the positive class alone
    aucs = []
    for c in classes:
        pos, neg = positive[c], negative[c]
        if pos.sum() == 0 or neg.sum() == 0:
            continue  # undefined for a class that never (or always) occurs
        below = np.cumsum(neg) - neg  # negatives in lower bins
        aucs.append(float((pos * (below + 0.5 * neg)).sum() / (pos.sum() * neg.sum())))
    return float(np.mean(aucs)) if aucs else math.nan


def _error_sums(name: str, power: int) -> Callable[[jax.Array, dict, jax.Array], Sums]:
    def sums(logits: jax.Array, batch: dict, weight: jax.Array) -> Sums:
        y = jnp.asarray(batch["y"], jnp.float32)
        out = logits.astype(jnp.float32)
        if out.shape != y.shape and out.shape == y.shape + (1,):
            out = out[..., 0]
        if out.shape != y.shape:
            raise ConfigError(f"metric {name!r}: outputs {tuple(out.shape)} and targets {tuple(y.shape)} differ")
        w = _weights(batch, weight, y.shape)
        return {"error": jnp.sum(jnp.abs(out - y).reshape(-1) ** power * w), "count": jnp.sum(w)}

    return sums


def _perplexity_sums(logits: jax.Array, batch: dict, weight: jax.Array) -> Sums:
    scores, y, _ = _classes("perplexity", logits, batch)
    w = _weights(batch, weight, batch["y"].shape)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(scores, -1), y[:, None], axis=-1)[:, 0]
    return {"nll": jnp.sum(nll * w), "count": jnp.sum(w)}


# -------------------------------------------------------------------------------------------- the metrics


def accuracy() -> Score:
    """The share of rows (or counted tokens) whose largest score is the label's."""
    return Score("accuracy", _confusion_sums("accuracy"), _averaged("recall", "micro"))


def top_k_accuracy(k: int = 5) -> Score:
    """The share of rows whose label is among the k largest scores (ties counted as hits)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"top_k_accuracy: k must be a positive integer, got {k!r}")
    return Score(f"top{k}_accuracy", _top_k_sums(k), lambda t: _safe(t["hits"], t["rows"]))


def precision(average: str = "macro") -> Score:
    """Of the rows predicted as a class, the share that are of it; "macro" or "micro" (module docstring)."""
    return _classification("precision", average)


def recall(average: str = "macro") -> Score:
    """Of the rows of a class, the share predicted as it; "macro" or "micro" (module docstring)."""
    return _classification("recall", average)


def f1(average: str = "macro") -> Score:
    """The harmonic mean of precision and recall per class, from the summed confusion counts."""
    return _classification("f1", average)


def confusion_matrix() -> Score:
    """Counts [true class][predicted class], as scikit-learn's `confusion_matrix` lays them out."""
    value = lambda t: np.rint(np.asarray(t["confusion"])).astype(int).tolist()  # noqa: E731
    return Score("confusion_matrix", _confusion_sums("confusion_matrix"), value, scalar=False)


def roc_auc(bins: int = 1000) -> Score:
    """The area under the ROC curve from histograms of the predicted probability (`bins` equal bins)."""
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 2:
        raise ConfigError(f"roc_auc: bins must be an integer >= 2, got {bins!r}")
    return Score("roc_auc", _auc_sums(bins), _auc_value)


def mae() -> Score:
    """The mean absolute error of the outputs against float targets `y`, over every element."""
    return Score("mae", _error_sums("mae", 1), lambda t: _safe(t["error"], t["count"]))


def mse() -> Score:
    """The mean squared error of the outputs against float targets `y`, over every element."""
    return Score("mse", _error_sums("mse", 2), lambda t: _safe(t["error"], t["count"]))


def perplexity() -> Score:
    """exp of the mean negative log-likelihood over every counted token (not the mean of per-batch perplexities)."""
    return Score("perplexity", _perplexity_sums, lambda t: float(np.exp(_safe(t["nll"], t["count"]))))


def _classification(kind: str, average: str) -> Score:
    if average not in ("macro", "micro"):
        raise ConfigError(f"{kind}: average must be 'macro' or 'micro', got {average!r}")
    name = kind if average == "macro" else f"{kind}_micro"
    return Score(name, _confusion_sums(name), _averaged(kind, average))


def _safe(total: Any, count: Any) -> float:
    return float(total) / float(count) if float(count) else math.nan


BY_NAME: dict[str, Callable[[], Score]] = {
    "accuracy": accuracy,
    "top5_accuracy": lambda: top_k_accuracy(5),
    "precision": precision,
    "recall": recall,
    "f1": f1,
    "precision_micro": lambda: precision("micro"),
    "recall_micro": lambda: recall("micro"),
    "f1_micro": lambda: f1("micro"),
    "confusion_matrix": confusion_matrix,
    "roc_auc": roc_auc,
    "mae": mae,
    "mse": mse,
    "perplexity": perplexity,
}


def get_scores(metrics: Sequence[Any] | None, owner: str) -> tuple[Any, ...]:
    """The metrics named (see BY_NAME) or given (a `Score`, or any object with name, sums and value); an unknown
    name or object is one ConfigError naming it."""
    if metrics is None:
        return ()
    if isinstance(metrics, (str, Score)):
        metrics = [metrics]
    out = []
    for m in metrics:
        if isinstance(m, str):
            if m not in BY_NAME:
                raise ConfigError(
                    f"{owner}: unknown metric {m!r}; known: {', '.join(BY_NAME)} (or a jaxnn.scores.Score)"
                )
            m = BY_NAME[m]()
        elif not all(hasattr(m, a) for a in ("name", "sums", "value")):
            raise ConfigError(f"{owner}: {m!r} is not a metric (a name, or an object with name, sums and value)")
        out.append(m)
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{owner}: metric names repeat: {names}")
    return tuple(out)


__all__ = [
    "BY_NAME",
    "Score",
    "accuracy",
    "confusion_matrix",
    "f1",
    "get_scores",
    "mae",
    "mse",
    "perplexity",
    "precision",
    "recall",
    "roc_auc",
    "top_k_accuracy",
]
