"""Step time while checkpoints are written: orbax's asynchronous save against the synchronous one, in `jaxnn.fit`.

    python -m benchmarks.checkpoint_saving [--width 2048] [--steps 60] [--every 10] [--rounds 2] [--json out.json]

A wide MLP (a large state for little compute, so that saving shows) trains on random data for `--steps` steps with
a checkpoint every `--every` steps, asynchronously, synchronously, and without checkpoints, the arrangements
alternating over `--rounds`. Per-step wall times come from a callback's timestamps (each step's metrics are read
one step late, so consecutive timestamps are one step apart); reported are the median step, the median step that
included a save, and the whole loop's time, as medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

import jaxnn
from benchmarks.output import add_json_flags, params_label, refuse_existing
from jaxnn import layers as L
from jaxnn.callbacks import Callback


class StepClock(Callback):
    """Wall time between consecutive steps' metrics."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []

    def on_step(self, run, step, metrics):  # noqa: ANN001, ANN201 - the Callback signature
        self.times.append((step, time.perf_counter()))

    def intervals(self) -> dict[int, float]:
        return {b[0]: b[1] - a[1] for a, b in zip(self.times, self.times[1:])}


def run_once(arrangement: str, args: argparse.Namespace, data: tuple[np.ndarray, np.ndarray]) -> dict:
    model = L.serial(*[layer for _ in range(3) for layer in (L.Dense(args.width), L.Relu)], L.Dense(10))
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        jaxnn.fit(
            model,
            data,
            steps=args.steps,
            batch_size=64,
            callbacks=[clock],
            progress=False,
            plots=False,
            run_dir=tmp,
            ckpt_every=args.every if arrangement != "none" else 0,
            keep=2,
            async_checkpoints=arrangement == "async",
            guard_nonfinite=False,
            compile_cache="off",  # the benchmarks split XLA's scratch, which the cache cannot hold
        )
        total = time.perf_counter() - t0
    steps = clock.intervals()
    # Iteration s reads (and timestamps) step s - 1's metrics, then saves; step s's metrics are read in
    # iteration s + 1. So the save of iteration s falls between the timestamps of steps s - 1 and s: key s.
    saving = [dt for s, dt in steps.items() if s % args.every == 0 and s > 2]
    plain = [dt for s, dt in steps.items() if s % args.every != 0 and s > 2]
    return {
        "arrangement": arrangement,
        "total_s": total,
        "step_ms": 1e3 * statistics.median(plain),
        "step_with_save_ms": 1e3 * statistics.median(saving) if saving and arrangement != "none" else None,
    }


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    add_json_flags(p)
    args = p.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((1024, 64)).astype(np.float32), rng.integers(0, 10, 1024).astype(np.int32))
    rows: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for arrangement in ("async", "sync", "none"):
            rows.setdefault(arrangement, []).append(run_once(arrangement, args, data))
    params = 64 * args.width + 2 * args.width * args.width + 10 * args.width
    print(
        f"MLP 64-{args.width}x3-10 ({params_label(params)} params, state {params * 12 / 2**20:.0f} MiB with Adam), "
        f"{args.steps} steps, checkpoint every {args.every}, medians of {args.rounds} rounds"
    )
    result = []
    for arrangement, runs in rows.items():
        row = {
            "arrangement": arrangement,
            **{key: _median(runs, key) for key in ("total_s", "step_ms", "step_with_save_ms")},
        }
        result.append(row)
        with_save = f"{row['step_with_save_ms']:.1f} ms" if row["step_with_save_ms"] else "-"
        print(
            f"  {arrangement:5s}  loop {row['total_s']:.2f} s   step {row['step_ms']:.1f} ms   "
            f"step with a save {with_save}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
