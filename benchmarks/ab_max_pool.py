"""Side by side: MaxPool's two lowerings, the pool's gradient alone and the benchmark CNN's whole train step.

Run: `.venv/bin/python -m benchmarks.ab_max_pool [fp32|bf16] [--repeats 9]`; interleaved windows, medians, one process.
Figures and what they decided: docs/performance.md, "Reshape max pooling".
"""

import argparse

import jax
import jax.numpy as jnp
import optax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from jaxnn import layers as L
from jaxnn import train
from jaxnn.profile.timing import time_interleaved

LOWERINGS = ("reduce_window", "reshape")


def pool_gradients():
    fns = {}
    for shape in [(64, 32, 32, 32), (64, 16, 16, 64), (64, 8, 8, 128)]:
        x = jax.random.normal(jax.random.key(0), shape)
        cotangent = jax.random.normal(jax.random.key(1), (shape[0], shape[1] // 2, shape[2] // 2, shape[3]))
        for lowering in LOWERINGS:
            pool = L.MaxPool(2, lowering=lowering)
            grad = jax.jit(jax.grad(lambda x, pool=pool, g=cotangent: jnp.vdot(pool.apply({}, x), g)))
            fns[f"pool grad {shape[1]}x{shape[2]}x{shape[3]} {lowering}"] = lambda grad=grad, x=x: grad(x)
    return fns


def cnn_steps(precision):
    x = jax.random.normal(jax.random.key(1), (64, 32, 32, 3))
    batch = {"x": x, "y": jax.random.randint(jax.random.key(2), (64,), 0, 10)}
    tx = optax.adam(1e-3)
    states, fns = {}, {}
    for lowering in LOWERINGS:
        # models/cnn.py's CNN with the pool lowering forced
        stages = [
            layer
            for width in (32, 64, 128)
            for layer in (L.Conv(width, 3, padding="SAME"), L.Relu, L.MaxPool(2, padding="SAME", lowering=lowering))
        ]
        model = L.serial(*stages, L.Flatten(), L.Dense(10))
        states[lowering] = train.create_train_state(model, tx, jax.random.key(0), x.shape, precision)
        step = train.make_train_step(model, train.classification_loss, tx, precision)

        def run(lowering=lowering, step=step):
            states[lowering], metrics = step(states[lowering], batch)
            return metrics

        fns[f"cnn step {precision} {lowering}"] = run
    return fns


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("precision", nargs="?", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--repeats", type=int, default=9, help="timing windows per case (1: a smoke run)")
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    print(f"median ms of {args.repeats} interleaved windows; {cpu_label()}, jax {jax.__version__}")
    timings = time_interleaved({**pool_gradients(), **cnn_steps(args.precision)}, warmup=2, repeats=args.repeats)
    for name, t in timings.items():
        print(f"{name:40s} {t.median * 1e3:8.2f} ms")
