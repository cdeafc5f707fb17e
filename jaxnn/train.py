"""Compiled training: TrainState, the pure train step, the eval step, and K steps per call with lax.scan.

A step is a pure function `(state, batch) -> (state, metrics)`; `batch` is a dict with inputs `"x"` and targets
`"y"`. Randomness for a step is `fold_in(state.key, state.step)` (big_vision's habit), so a resumed run draws the
same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax

from jaxnn._src.pytree import is_prng_key
from jaxnn.layers.core import Layer, Params, PRNGKey, Shape, State, init_model, run
from jaxnn.precision import LossScale, Policy, all_finite, get_policy

# "x" inputs, "y" targets, optionally "mask" and "y_soft" (mixed targets): arrays with a leading batch axis
Batch: TypeAlias = dict[str, Any]
Metrics: TypeAlias = dict[str, jax.Array]
LossFn: TypeAlias = Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]
# `(batch, train key, step, global index of the batch's first row) -> batch`: random augmentation in the step,
# e.g. `functools.partial(jaxnn.augment.augment_batch, Augment(...))`.
AugmentFn: TypeAlias = Callable[[Batch, jax.Array, jax.Array, Any], Batch]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step; a pytree, so it is jitted, sharded and saved whole."""

    params: Params
    model_state: State  # e.g. BatchNorm running statistics; {} for stateless models
    opt_state: optax.OptState
    step: jax.Array
    key: jax.Array  # raw uint32 key data (`jax.random.key_data`), not a typed key: see create_train_state
    loss_scale: LossScale | None  # fp16's dynamic loss scale; None for policies that need none


# A train step `(state, batch) -> (state, metrics)`, as train_step_fn returns it (jitted, it is a jax.stages.Wrapped).
StepFn: TypeAlias = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]


def create_train_state(
    model: Layer,
    tx: optax.GradientTransformation,
    key: PRNGKey,
    in_shape: Shape,
    policy: Policy | str = "fp32",
) -> TrainState:
    """Initialises parameters (in the policy's parameter dtype), model state and optimizer state."""
    check_optimizer(tx, "create_train_state: tx (the optimizer)")
    policy = get_policy(policy)
    init_key, train_key = jax.random.split(key)
    _, params, model_state = init_model(model, init_key, in_shape)
    params = policy.cast_to_param(params)
    # None (no leaves) unless the policy scales the loss: every leaf of the state costs dispatch time per step.
    loss_scale = LossScale.create() if policy.loss_scaling else None
    # Stored as raw key data: a typed key array in the arguments takes jit's slower dispatch path, which cost a
    # tiny model's step 4-20% (benchmarks/ab_train_step.py); jax.random reads raw data as the default implementation's
    # key, so a key of another implementation (e.g. "rbg") stays typed.
    if is_prng_key(train_key) and jax.random.key_impl(train_key) == jax.random.key_impl(jax.random.key(0)):
        train_key = jax.random.key_data(train_key)
    return TrainState(params, model_state, tx.init(params), jnp.zeros((), jnp.int32), train_key, loss_scale)


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


def weight_decay_mask(params: Params) -> Any:
    """True for kernels (leaves named "w"), False for biases, norm scales and embedding tables."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "w", params)


# The decays `make_schedule` offers after the warm-up; `jaxnn train --schedule` is checked against them.
SCHEDULES = ("cosine", "constant")


def make_schedule(
    learning_rate: float = 1e-3, *, total_steps: int = 1000, warmup_steps: int = 0, decay: str = "cosine"
) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `warmup_steps`, then cosine decay to 0 at `total_steps`
    (`decay="cosine"`) or `learning_rate` from then on (`decay="constant"`: a run can be trained on past
    `total_steps` along the same schedule)."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate!r}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps!r}")
    if decay not in SCHEDULES:
        raise ValueError(f"unknown schedule {decay!r}; choose one of {list(SCHEDULES)}")
    if decay == "constant":
        return optax.warmup_constant_schedule(0.0 if warmup_steps else learning_rate, learning_rate, warmup_steps)
    return optax.warmup_cosine_decay_schedule(
        0.0 if warmup_steps else learning_rate, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1)
    )


def make_optimizer(
    learning_rate: float = 1e-3,
    *,
    total_steps: int = 1000,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    decay: str = "cosine",
) -> optax.GradientTransformation:
    """AdamW on `make_schedule`, global-norm clipping, and decay on kernels only (all optax)."""
    schedule = make_schedule(learning_rate, total_steps=total_steps, warmup_steps=warmup_steps, decay=decay)
    adamw = optax.adamw(schedule, weight_decay=weight_decay, mask=weight_decay_mask)
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw


# A packed batch's keys that reach the model as side inputs, where it takes them (`jaxnn.data.packing`); a batch's
# other keys (`y`, `mask` of padded examples, `loss_mask`) are the loss's.
PACKED_SIDE_INPUTS = ("segment_ids", "positions")


def forward_batch(
    model: Layer,
    policy: Policy,
    params: Params,
    model_state: State,
    batch: Batch,
    *,
    key: PRNGKey | None,
    train: bool,
) -> tuple[Any, State]:
    """The model's output for `batch["x"]` under `policy` (parameters and input cast to its compute dtype, the
    output to its output dtype), and the model state after it: what every step, evaluation and prediction runs.
    A packed batch's `segment_ids` and `positions` go to a model that takes them."""
    logits, model_state = run(
        model,
        policy.cast_to_compute(params),
        policy.cast_to_compute(batch["x"]),
        state=model_state,
        key=key,
        train=train,
        policy=policy,
        **{k: batch[k] for k in PACKED_SIDE_INPUTS if k in batch and k in model.side_inputs},
    )
    return policy.cast_to_output(logits), model_state


def check_optimizer(tx: Any, argument: str = "optimizer") -> None:
    """Refuses anything but an optax GradientTransformation (a None optimizer would fail deep inside the step);
    `argument` names it as the caller's signature does."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{argument} must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got {type(tx).__name__}"
        )


def train_step_fn(
    model: Layer,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    grad_norm: bool = True,
    accumulate: int = 1,
    augment: AugmentFn | None = None,
) -> StepFn:
    """The un-jitted pure step `(state, batch) -> (state, metrics)`; jit it, scan it, or shard_map it.

    `augment` transforms the batch first, in the step, from the state's key and step (rows numbered from 0: a
    per-device step passes its own offset instead, see `jaxnn.parallel.per_device_step_fn`).

    Metrics: the loss, what `loss_fn` returns besides it, and (unless `grad_norm=False`) the global gradient
    norm, which costs a reduction over every gradient and one more output: with the accuracy, ~11% of the
    benchmark MLP's step and ~27% of a tiny model's (docs/performance.md, "Dispatch of the tiny step").

    `accumulate=K` splits the batch into K equal micro-batches (rows i, i+K, i+2K, ...: each micro-batch keeps
    the batch's split over devices) and averages their gradients in a `lax.scan` before one optimizer update,
    so activations are held for B/K rows at a time. The loss reaches an optax transformation that takes
    `value` (e.g. `optax.contrib.reduce_on_plateau`) as `tx.update(..., value=loss)`.
    """
    check_optimizer(tx)
    policy = get_policy(policy)
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
    takes_value = isinstance(tx, optax.GradientTransformationExtraArgs)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if augment is not None:
            batch = augment(batch, state.key, state.step, 0)
        key = jax.random.fold_in(state.key, state.step)
        # The state's loss scale when the policy scales the loss (None otherwise, even if the state has one).
        scale = _loss_scale_of(state, policy) if policy.loss_scaling else None

        def scaled_loss(params: Params, model_state: State, batch: Batch, key: PRNGKey) -> tuple[jax.Array, Any]:
            logits, model_state = forward_batch(model, policy, params, model_state, batch, key=key, train=True)
            loss, metrics = loss_fn(logits, batch)
            scaled = scale.scale_loss(loss) if scale is not None else loss
            return scaled, (loss, metrics, model_state)

        grad_fn = _frozen_integers(jax.grad(scaled_loss, has_aux=True, allow_int=True))
        if accumulate == 1:
            grads, (loss, metrics, model_state) = grad_fn(state.params, state.model_state, batch, key)
        else:
            grads, (loss, metrics, model_state) = _accumulated(grad_fn, state, batch, key, accumulate)
        if scale is not None:  # without it, skip the multiply and divide: small models pay for every op
            grads = scale.unscale(grads)
        extra = {"value": loss} if takes_value else {}
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if scale is not None:
            # An overflowing fp16 step changes nothing but the scale (halved); the step counter still advances.
            finite = all_finite(grads)

            def keep_new(new, old):
                return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

            params = keep_new(params, state.params)
            opt_state = keep_new(opt_state, state.opt_state)
            model_state = keep_new(model_state, state.model_state)
            loss_scale = scale.adjust(finite)
            metrics = {**metrics, "grads_finite": finite, "loss_scale": loss_scale.scale}
        metrics = {**metrics, "loss": loss}
        if grad_norm:
            metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(params, model_state, opt_state, state.step + 1, state.key, loss_scale), metrics

    return step


def micro_batches(batch: Batch, k: int) -> Batch:
    """`batch` as K micro-batches stacked on a new leading axis: micro-batch i holds rows i, i + K, i + 2K, ...

    Strided rather than contiguous: each device's contiguous block of rows then feeds every micro-batch equally,
    so the micro-batches stay split over the devices the way the batch was.
    """

    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % k:
            raise ValueError(f"accumulate={k} does not divide the batch of {x.shape[0]} rows")
        return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def _frozen_integers(grad_fn: Callable) -> Callable:
    """`grad_fn` whose gradients for integer leaves (a base stored quantised under LoRA, `jaxnn.quantized`) are
    zeros of the leaf's own dtype rather than jax's float0: the optimizer, accumulation and the loss scale then
    handle one kind of tree. Such leaves are frozen by construction; nothing can differentiate an integer."""

    def with_zeros(params: Params, *args: Any) -> tuple[Any, Any]:
        grads, aux = grad_fn(params, *args)
        frozen = jax.tree.map(lambda g, p: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g, grads, params)
        return frozen, aux

    return with_zeros


def _accumulated(grad_fn: Callable, state: TrainState, batch: Batch, key: jax.Array, k: int) -> tuple[Any, Any]:
    """Mean gradient, loss and metrics over K micro-batches; the model state (BatchNorm) runs through them in order."""

    def body(carry, xs):
        grads_sum, model_state = carry
        i, micro = xs
        grads, (loss, metrics, model_state) = grad_fn(state.params, model_state, micro, jax.random.fold_in(key, i))
        return (jax.tree.map(jnp.add, grads_sum, grads), model_state), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads_sum, model_state), (losses, metrics) = jax.lax.scan(
        body, (zeros, state.model_state), (jnp.arange(k), micro_batches(batch, k))
    )
    grads = jax.tree.map(lambda g: g / k if jnp.issubdtype(g.dtype, jnp.inexact) else g, grads_sum)
    return grads, (losses.mean(), jax.tree.map(lambda m: m.mean(axis=0), metrics), model_state)


def _loss_scale_of(state: TrainState, policy: Policy) -> LossScale:
    if state.loss_scale is None:
        raise ValueError(
            f"policy {policy.name!r} scales the loss, but the TrainState has no loss_scale; "
            "create the state with the policy it is trained with (create_train_state(..., policy))"
        )
    return state.loss_scale


def make_train_step(
    model: Layer,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    donate: bool = True,
    grad_norm: bool = True,
    accumulate: int = 1,
    **jit_kwargs: Any,
) -> jax.stages.Wrapped:
    """The jitted train step; the incoming state's buffers are donated (reused for the new state).

    `accumulate=K`: K micro-batches per update (see `train_step_fn`)."""
    step = train_step_fn(model, loss_fn, tx, policy, grad_norm=grad_norm, accumulate=accumulate)
    return jax.jit(step, donate_argnums=(0,) if donate else (), **jit_kwargs)


def make_multi_step(
    model: Layer,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    donate: bool = True,
    grad_norm: bool = True,
    **jit_kwargs: Any,
) -> jax.stages.Wrapped:
    """K steps per call: `(state, batches) -> (state, metrics)` where every leaf of `batches` has a leading K axis.

    One dispatch runs K steps inside a `lax.scan`, which takes Python dispatch off the critical path for small
    models; the metrics come back stacked with a leading K axis.
    """
    step = train_step_fn(model, loss_fn, tx, policy, grad_norm=grad_norm)

    def multi_step(state: TrainState, batches: Batch) -> tuple[TrainState, Metrics]:
        _check_stacked(batches)
        return jax.lax.scan(step, state, batches)

    return jax.jit(multi_step, donate_argnums=(0,) if donate else (), **jit_kwargs)


def _check_stacked(batches: Batch) -> None:
    """Refuses stacked batches without a common leading K >= 1 (K = 0 would run no step and say nothing)."""
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(batches)}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
        raise ValueError(
            "make_multi_step: every batch leaf needs the same leading K >= 1 (steps per call), "
            f"got {sorted(map(str, sizes))}"
        )


def make_eval_step(
    model: Layer, loss_fn: LossFn, policy: Policy | str = "fp32", **jit_kwargs: Any
) -> jax.stages.Wrapped:
    """The jitted eval step `(state, batch) -> metrics`: eval mode (no dropout, BatchNorm running statistics)."""
    policy = get_policy(policy)

    def eval_step(state: TrainState, batch: Batch) -> Metrics:
        logits, _ = forward_batch(model, policy, state.params, state.model_state, batch, key=None, train=False)
        loss, metrics = loss_fn(logits, batch)
        return {**metrics, "loss": loss}

    return jax.jit(eval_step, **jit_kwargs)


def make_predict(model: Layer, policy: Policy | str = "fp32", **jit_kwargs: Any) -> jax.stages.Wrapped:
    """The jitted inference function `(params, model_state, x) -> logits` in eval mode."""
    policy = get_policy(policy)

    def predict(params: Params, model_state: State, x: jax.Array) -> Any:
        return forward_batch(model, policy, params, model_state, {"x": x}, key=None, train=False)[0]

    return jax.jit(predict, **jit_kwargs)
