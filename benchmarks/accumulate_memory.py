"""Gradient accumulation: the compiled step's temporary (activation) memory as `accumulate` grows.

    python -m benchmarks.accumulate_memory [--batch 4096] [--width 256] [--k 1 2 4 8] [--json out.json]

For each K, the training step of an MLP (wide hidden layers, so activations dominate) is lowered and compiled on
one batch of `--batch` rows; reported is XLA's `memory_analysis()` of the executable: temporary bytes (the
activations kept for the backward pass live there) next to argument and output bytes (the state, the same for
every K). With K micro-batches only `batch / K` rows of activations are alive at once, so the temporary bytes
should fall about K-fold until the parameters' gradient accumulator (one copy of the parameters) dominates.
Nothing is timed: the figures come from the compiler, and are the same on every run.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import optax

from benchmarks.generation import cpu_name
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn import layers as L
from jaxnn.train import create_train_state, make_train_step, masked_classification_loss


def memory(batch: int, width: int, k: int) -> dict:
    model = L.serial(L.Dense(width), L.Relu, L.Dense(width), L.Relu, L.Dense(width), L.Relu, L.Dense(10))
    tx = optax.sgd(0.1)
    state = create_train_state(model, tx, jax.random.key(0), (batch, 64))
    data = {"x": jnp.zeros((batch, 64), jnp.float32), "y": jnp.zeros((batch,), jnp.int32)}
    step = make_train_step(model, masked_classification_loss, tx, donate=False, accumulate=k)
    stats = step.lower(state, data).compile().memory_analysis()
    return {
        "accumulate": k,
        "micro_batch": batch // k,
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    add_json_flags(parser)
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rows = [memory(args.batch, args.width, k) for k in args.k]
    print(f"{jax.default_backend()} ({cpu_name()}), batch {args.batch}, width {args.width}")
    print(f"{'K':>3} {'micro':>6} {'temp MiB':>9} {'vs K=1':>7} {'params MiB':>11}")
    for row in rows:
        print(
            f"{row['accumulate']:>3} {row['micro_batch']:>6} {row['temp_bytes'] / 2**20:>9.2f} "
            f"{rows[0]['temp_bytes'] / max(row['temp_bytes'], 1):>6.1f}x {row['param_bytes'] / 2**20:>11.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": jax.default_backend(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
