"""Tokens per second of `jaxnn.generate.generate` with the KV cache against repeated full forward passes.

    python -m benchmarks.generation [--new-tokens 256] [--prompt 64] [--batch 1 8] [--rounds 3] [--json out.json]

The model is the built-in GPT at its default width (d_model 256, 4 layers, 4 heads) with a position table long
enough for prompt + new tokens. Both paths are one compiled program (prefill + lax.scan over positions, or a
lax.scan of full forward passes over a fixed-size buffer); compile time is reported apart and the timed runs are
medians over rounds, the two paths alternating. Greedy decoding, so both must return the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from jaxnn.generate import generate
from jaxnn.models import GPT, GPTConfig


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def timed(fn) -> float:  # noqa: ANN001 - any zero-argument callable returning arrays
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure(batch: int, args: argparse.Namespace) -> dict:
    cfg = GPTConfig(seq_len=args.prompt + args.new_tokens)
    model = GPT(cfg)
    _, params = model.init(jax.random.key(0), (1, 8))
    prompt = jax.random.randint(jax.random.key(1), (batch, args.prompt), 0, cfg.vocab_size)
    runs = {
        "cache": lambda: generate(model, params, prompt, args.new_tokens),
        "no_cache": lambda: generate(model, params, prompt, args.new_tokens, use_cache=False),
    }
    first = {name: timed(fn) for name, fn in runs.items()}  # compile + one run
    same = bool(np.array_equal(runs["cache"](), runs["no_cache"]()))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    tokens = batch * args.new_tokens
    return {
        "batch": batch,
        "same_tokens": same,
        "first_call_s": first,
        "median_s": medians,
        "tokens_per_s": {name: tokens / t for name, t in medians.items()},
        "speedup": medians["no_cache"] / medians["cache"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(b, args) for b in args.batch]
    print(f"GPT d_model 256, 4 layers; prompt {args.prompt}, {args.new_tokens} new tokens, greedy; {cpu_name()}")
    print(f"{'batch':>5} {'cache tok/s':>12} {'no cache tok/s':>15} {'speed-up':>9} {'same tokens':>12}")
    for r in rows:
        tps = r["tokens_per_s"]
        print(
            f"{r['batch']:>5} {tps['cache']:>12.0f} {tps['no_cache']:>15.0f} {r['speedup']:>8.1f}x "
            f"{r['same_tokens']!s:>12}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
