"""The compiled steps: the pure train step (`train_step_fn`, gradient accumulation over micro-batches, fp16's
loss scale), the jitted train step, K steps per call with `lax.scan`, the eval step and prediction.

A step is a pure function `(state, batch) -> (state, metrics)`; `batch` is a dict with inputs `"x"` and targets
`"y"`. Randomness for a step is `fold_in(state.key, state.step)` (big_vision's habit), so a resumed run draws the
same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxnn import fp8
from jaxnn.layers.core import Layer, Params, PRNGKey, State, run
from jaxnn.precision import LossScale, Policy, all_finite, get_policy
from jaxnn.train.optim import check_optimizer
from jaxnn.train.state import AugmentFn, Batch, LossFn, Metrics, StepFn, TrainState

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
    per-device step passes its own offset instead, see `jaxnn.train.data_parallel.per_device_step_fn`).

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
        if policy.fp8_history:  # the new amax histories, written below rather than handed to the optimizer
            histories, grads = fp8.split_histories(grads)
        if scale is not None:  # without it, skip the multiply and divide: small models pay for every op
            grads = scale.unscale(grads)
        extra = {"value": loss} if takes_value else {}
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        if policy.fp8_history:
            params = fp8.put_histories(params, histories)
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

    # An fp8 amax history's "gradient" is the history updated with a micro-batch's maxima: the batch's is their
    # elementwise maximum (each starts from the same history), not their sum or mean.
    history = fp8.history_mask(state.params)

    def body(carry, xs):
        grads_sum, model_state = carry
        i, micro = xs
        grads, (loss, metrics, model_state) = grad_fn(state.params, model_state, micro, jax.random.fold_in(key, i))
        combined = jax.tree.map(lambda h, a, b: jnp.maximum(a, b) if h else a + b, history, grads_sum, grads)
        return (combined, model_state), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads_sum, model_state), (losses, metrics) = jax.lax.scan(
        body, (zeros, state.model_state), (jnp.arange(k), micro_batches(batch, k))
    )
    grads = jax.tree.map(
        lambda h, g: g / k if jnp.issubdtype(g.dtype, jnp.inexact) and not h else g, history, grads_sum
    )
    return grads, (losses.mean(), jax.tree.map(lambda m: m.mean(axis=0), metrics), model_state)


def _loss_scale_of(state: TrainState, policy: Policy) -> LossScale:
    if state.loss_scale is None:
        raise ValueError(
            f"policy {policy.name!r} scales the loss, but the TrainState has no loss_scale; "
            "create the state with the policy it is trained with (create_train_state(..., policy))"
        )
    return state.loss_scale


def jit_step(step: Callable, *, donate: bool = True, **jit_kwargs: Any) -> jax.stages.Wrapped:
    """`step`, a function `(state, ...) -> (state, ...)`, jitted: the one place a train step is compiled
    (`make_train_step`, `make_multi_step`, and the data-parallel forms' `jaxnn.train.data_parallel`). With
    `donate`, the incoming state's buffers are reused for the new state, so the caller must not read it again;
    `jit_kwargs` go to `jax.jit` (e.g. shardings)."""
    return jax.jit(step, donate_argnums=(0,) if donate else (), **jit_kwargs)


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
    return jit_step(step, donate=donate, **jit_kwargs)


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

    return jit_step(multi_step, donate=donate, **jit_kwargs)


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
