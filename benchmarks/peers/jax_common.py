"""What the JAX peers share: the loss, and the plain `jax.jit` Adam step that each of them is timed with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from benchmarks.train_steps import LEARNING_RATE, SPECS, synthetic_batch
from jaxnn.profile.timing import stepper


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def device_batch(name: str) -> dict:
    return jax.tree.map(jnp.asarray, synthetic_batch(name))


def adam_step(loss_fn, params, name: str):
    """The idiomatic step `((params, opt_state), batch) -> ((params, opt_state), loss)`, jitted with donation, and
    a no-argument callable that advances it on the benchmark batch (what `time_fn` calls)."""
    tx = optax.adam(LEARNING_RATE)
    batch = device_batch(name)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return stepper(jax.jit(step, donate_argnums=0), (params, tx.init(params)), batch)


def spec(name: str) -> dict:
    return SPECS[name]
