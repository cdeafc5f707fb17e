"""jaxnn itself, run through the peers' harness so that it is timed in a process of its own like every peer, with
its defaults: the oneDNN kernels this CPU measured faster (`jaxnn.kernels.onednn.choice`), named in each row.

The "jaxnn" row computes what every peer's step computes: the update and the loss, nothing else. The
"jaxnn_metrics" row (`peer_jaxnn_metrics`) is jaxnn's default step, which also returns the accuracy (or bits per
token) and the global gradient norm every step; the difference between the two is the cost of those metrics.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks.peers.common import main
from benchmarks.train_steps import LEARNING_RATE, jaxnn_model, synthetic_batch
from jaxnn import train
from jaxnn.layers.attention_kernels import cpu_implementation
from jaxnn.profile.timing import stepper


def kernels(name: str, precision: str) -> str:
    """Where this row's convolutions and products ran on the CPU (oneDNN's kernels or XLA's, as traced), the GPT's
    attention path, and how malloc treated XLA's scratch memory between steps (`jaxnn._src.malloc`)."""
    from jaxnn._src import malloc
    from jaxnn.kernels import onednn

    memory = f"host memory {malloc.status()}"
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    attention = f", attention {cpu_implementation(dtype)}" if name == "gpt" else ""
    if not onednn.available():
        return f"XLA (oneDNN kernels not built){attention}; {memory}"
    products = ", ".join(f"{kind} {'oneDNN' if onednn.enabled(kind, dtype) else 'XLA'}" for kind in ("conv", "matmul"))
    return f"{products}{attention}; {memory}"


def build(name: str, precision: str, *, metrics: bool = False, **gpt_overrides):
    model, loss_fn = jaxnn_model(name, **gpt_overrides)
    if not metrics:
        full_loss = loss_fn
        loss_fn = lambda logits, batch: (full_loss(logits, batch)[0], {})  # noqa: E731 (XLA drops the rest)
    tx = optax.adam(LEARNING_RATE)
    batch = jax.tree.map(jnp.asarray, synthetic_batch(name))
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, precision)
    step = train.make_train_step(model, loss_fn, tx, precision, grad_norm=metrics)
    return stepper(step, state, batch)


if __name__ == "__main__":
    sys.exit(main("jaxnn", build, describe=kernels))
