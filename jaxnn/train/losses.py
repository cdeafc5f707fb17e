"""The losses a step trains against: softmax cross-entropy against integer labels (without optax's gather), with a
mask, label smoothing and soft targets, and next-token cross-entropy for language models. Each is
`(logits, batch) -> (loss, metrics)`, a `jaxnn.train.LossFn`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxnn.train.state import Batch, Metrics


def integer_label_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy of `logits` (..., classes) against integer `labels` (...), in float32: the values of
    `optax.softmax_cross_entropy_with_integer_labels`, bit for bit (negative labels count from the end, a label
    out of range gives NaN).

    Why not optax's: it reads the label's logit with a gather, whose gradient is a scatter-add. Here the label's
    logit is a masked sum over the classes (one term is non-zero, so the sum is exact), whose gradient is a select
    that XLA fuses into the softmax's gradient. A small step then has three fewer ops to start with, which kept
    XLA's CPU runtime from handing half of a tiny MLP's bf16 step to a second thread (twice the step time,
    docs/performance.md, "Defaults per CPU"); GPUs do without the scatter's atomic adds."""
    logits = logits.astype(jnp.float32)
    classes = logits.shape[-1]
    labels = jnp.where(labels < 0, labels + classes, labels)
    hit = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) == labels[..., None]
    in_range = (labels >= 0) & (labels < classes)
    label_logits = jnp.where(in_range, jnp.sum(jnp.where(hit, logits, 0.0), axis=-1), jnp.nan)
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def classification_loss(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
    """Mean softmax cross-entropy against integer labels `batch["y"]` (or the soft targets `batch["y_soft"]`,
    e.g. mixup's, where the batch has them), with accuracy against `y` as a metric."""
    labels = batch["y"]
    if "y_soft" in batch:
        loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), batch["y_soft"]).mean()
    else:
        loss = integer_label_cross_entropy(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, {"accuracy": accuracy}


def masked_classification_loss(
    logits: jax.Array, batch: Batch, *, label_smoothing: float = 0.0
) -> tuple[jax.Array, Metrics]:
    """Softmax cross-entropy and accuracy over the rows whose `batch["mask"]` is 1 (all rows without a mask).

    Padding rows (mask 0, e.g. an epoch's or the test set's last partial batch) count for nothing; `count` in the
    metrics is the number of real rows, so evaluation can weight batches by it. `label_smoothing` (e.g. 0.1, via
    `functools.partial`) trains against `optax.smooth_labels` targets; accuracy still counts the integer labels.
    A batch with `y_soft` (B, classes), e.g. mixup's or cutmix's mixed one-hot targets (`jaxnn.augment`), trains
    against those instead (smoothed too, if asked).
    """
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not (0 <= label_smoothing < 1)
    ):
        raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    labels = batch["y"]
    logits32 = logits.astype(jnp.float32)
    if "y_soft" in batch:
        soft = batch["y_soft"].astype(jnp.float32)
        per_example = optax.softmax_cross_entropy(
            logits32, optax.smooth_labels(soft, label_smoothing) if label_smoothing else soft
        )
    elif label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        per_example = optax.softmax_cross_entropy(logits32, targets)
    else:
        per_example = integer_label_cross_entropy(logits32, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    mask = batch.get("mask")
    mask = jnp.ones_like(per_example) if mask is None else mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    return (per_example * mask).sum() / count, {"accuracy": (correct * mask).sum() / count, "count": mask.sum()}


def language_model_loss(logits_BTV: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
    """Next-token cross-entropy: `batch["y"]` holds the inputs shifted by one; reports bits per token too. With
    `batch["loss_mask"]` (B, T), the mean over the targets it weighs (e.g. a completion's, not its prompt's)."""
    per_token = integer_label_cross_entropy(logits_BTV, batch["y"])
    if "loss_mask" in batch:
        mask = batch["loss_mask"].astype(jnp.float32)
        loss = (per_token * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    else:
        loss = per_token.mean()
    return loss, {"bits_per_token": loss / jnp.log(2.0)}


def lm_loss(logits_BTV: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
    """`language_model_loss` with `count` for evaluation's weighting: the sequences in the batch, or the
    counted targets under a `loss_mask` (so evaluation is the exact mean over every counted token)."""
    loss, metrics = language_model_loss(logits_BTV, batch)
    if "loss_mask" in batch:
        return loss, {**metrics, "count": batch["loss_mask"].astype(jnp.float32).sum()}
    return loss, {**metrics, "count": jnp.asarray(batch["y"].shape[0], jnp.float32)}
