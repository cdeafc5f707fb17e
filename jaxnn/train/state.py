"""What a training run carries and the types its step passes around: `TrainState`, `create_train_state`, and the
`Batch`/`Metrics`/`LossFn`/`AugmentFn`/`StepFn` aliases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax

from jaxnn import fp8
from jaxnn._src.pytree import is_prng_key
from jaxnn.layers.core import Layer, Params, PRNGKey, Shape, State, init_model
from jaxnn.precision import LossScale, Policy, get_policy
from jaxnn.train.optim import check_optimizer

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


def params_for(policy: Policy | str, params: Params) -> Params:
    """`params` as a state under `policy` holds them: in its parameter dtype, with an fp8 amax history beside each
    fp8 kernel when the policy scales fp8 products from past steps (`jaxnn.fp8.with_histories`), without any
    otherwise."""
    policy = get_policy(policy)
    params = policy.cast_to_param(params)
    # Histories a policy without delayed scaling would not update (an optimizer would move them) are dropped.
    return fp8.with_histories(params, policy.fp8_history) if policy.fp8_history else fp8.without_histories(params)


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
    params = params_for(policy, params)
    # None (no leaves) unless the policy scales the loss: every leaf of the state costs dispatch time per step.
    loss_scale = LossScale.create() if policy.loss_scaling else None
    # Stored as raw key data: a typed key array in the arguments takes jit's slower dispatch path, which cost a
    # tiny model's step 4-20% (benchmarks/ab_train_step.py); jax.random reads raw data as the default implementation's
    # key, so a key of another implementation (e.g. "rbg") stays typed.
    if is_prng_key(train_key) and jax.random.key_impl(train_key) == jax.random.key_impl(jax.random.key(0)):
        train_key = jax.random.key_data(train_key)
    return TrainState(params, model_state, tx.init(params), jnp.zeros((), jnp.int32), train_key, loss_scale)
