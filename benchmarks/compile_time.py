"""Compile time of a GPT training step as depth grows: blocks written out flat against one `Repeat` (lax.scan).

    python -m benchmarks.compile_time [--layers 4 16 48] [--json out.json]

For each depth, the jitted step (forward, backward, AdamW update) of a small GPT (d_model 64, 2 heads, T 32) is
lowered and compiled once per form; reported are the seconds from tracing to a compiled executable and the median
time of a step (5 steps after one warm-up). The two forms are the same model; their blocks are initialised from
other keys (Repeat folds the layer index into its own key), so their first losses differ slightly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.generation import cpu_name
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn.models import GPT, GPTConfig
from jaxnn.train import create_train_state, language_model_loss, make_train_step


def compile_seconds(cfg: GPTConfig) -> tuple[float, float, float]:
    model = GPT(cfg)
    tx = optax.adamw(1e-3)
    state = create_train_state(model, tx, jax.random.key(0), (8, cfg.seq_len))
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    step = make_train_step(model, language_model_loss, tx, donate=False)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    seconds = time.perf_counter() - start
    _, metrics = compiled(state, batch)
    loss = float(jnp.asarray(metrics["loss"]))
    step_times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        step_times.append(time.perf_counter() - start)
    return seconds, statistics.median(step_times), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 48])
    add_json_flags(parser)
    args = parser.parse_args()
    refuse_existing(args.json, overwrite=args.overwrite)
    base = GPTConfig(seq_len=32, d_model=64, num_heads=2)
    rows = []
    for n in args.layers:
        row: dict = {"layers": n}
        for form, scan in (("flat", False), ("repeat", True)):
            measured = compile_seconds(dataclasses.replace(base, num_layers=n, scan_layers=scan))
            row.update({f"{form}_{what}": v for what, v in zip(("compile_s", "step_s", "loss"), measured)})
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "jax": jax.__version__, "rows": rows}, f, indent=2)
    print(f"GPT train step compile time (d_model 64, T 32, batch 8); {cpu_name()}, jax {jax.__version__}")
    print(f"{'layers':>6} {'compile flat s':>15} {'compile Repeat s':>17} {'step flat ms':>13} {'step Repeat ms':>15}")
    for r in rows:
        print(
            f"{r['layers']:>6} {r['flat_compile_s']:>15.1f} {r['repeat_compile_s']:>17.1f} "
            f"{1e3 * r['flat_step_s']:>13.1f} {1e3 * r['repeat_step_s']:>15.1f}"
        )


if __name__ == "__main__":
    main()
