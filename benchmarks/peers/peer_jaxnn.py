"""jaxnn itself, run through the peers' harness so that it is timed in a process of its own like every peer."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks.peers.common import main
from jaxnn import train
from jaxnn.bench import LEARNING_RATE, jaxnn_model, synthetic_batch


def build(name: str, precision: str):
    model, loss_fn = jaxnn_model(name)
    tx = optax.adam(LEARNING_RATE)
    batch = jax.tree.map(jnp.asarray, synthetic_batch(name))
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, precision)
    step = train.make_train_step(model, loss_fn, tx, precision)
    holder = [state]

    def call():
        holder[0], _ = step(holder[0], batch)
        return holder[0]

    return call


if __name__ == "__main__":
    sys.exit(main("jaxnn", build))
