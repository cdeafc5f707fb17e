"""Compile time of a GPT training step as depth grows: blocks written out flat against one `Repeat` (lax.scan).

    python -m benchmarks.compile_time [--layers 4 16 48] [--json out.json]

For each depth, the jitted step (forward, backward, AdamW update) of a small GPT (d_model 64, 2 heads, T 32) is
lowered and compiled once per form; reported are the seconds from tracing to a compiled executable, and the first
step's loss for both forms (equal: Repeat initialises layer i as the flat model's i-th block).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.generation import cpu_name
from jaxnn.models import GPT, GPTConfig
from jaxnn.train import create_train_state, language_model_loss, make_train_step


def compile_seconds(cfg: GPTConfig) -> tuple[float, float]:
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
    return seconds, float(jnp.asarray(metrics["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 48])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    base = GPTConfig(seq_len=32, d_model=64, num_heads=2)
    rows = []
    for n in args.layers:
        flat_s, flat_loss = compile_seconds(dataclasses.replace(base, num_layers=n))
        scan_s, scan_loss = compile_seconds(dataclasses.replace(base, num_layers=n, scan_layers=True))
        rows.append({"layers": n, "flat_s": flat_s, "scan_s": scan_s, "flat_loss": flat_loss, "scan_loss": scan_loss})
    print(f"GPT train step compile time (d_model 64, T 32, batch 8); {cpu_name()}, jax {jax.__version__}")
    print(f"{'layers':>6} {'flat s':>8} {'Repeat s':>9} {'loss flat':>10} {'loss Repeat':>12}")
    for r in rows:
        print(
            f"{r['layers']:>6} {r['flat_s']:>8.1f} {r['scan_s']:>9.1f} {r['flat_loss']:>10.4f} {r['scan_loss']:>12.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
