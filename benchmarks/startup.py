"""Start-up of `jaxnn train`: wall clock of whole runs with a cold, a warm and no persistent compilation cache.

    python -m benchmarks.startup [--models cnn gpt] [--rounds 3] [--gpt-steps 50] [--json out.json]

Each run is a fresh process of `python -m jaxnn.cli train` with the model's defaults (what `make train` runs; the
GPT with `--gpt-steps` steps). cold: an empty cache directory, so every program is compiled and written; warm: the
directory an earlier run of the same command filled; off: `--no-compile-cache`. The variants run in turn within
each round (interleaved, so a burst of load from other processes falls on all of them) and each figure is the
median over rounds. `import` is the floor no cache can cut: a process that imports jaxnn's training stack and
starts jax's CPU backend.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing

IMPORT_ONLY = "import jax, jaxnn.cli.recipes, jaxnn.loop; jax.devices()"


def train_cmd(model: str, run_dir: str, cache: str | None, gpt_steps: int, steps: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "jaxnn.cli", "train", "--model", model, "--run-dir", run_dir, "--overwrite"]
    if steps is not None or model == "gpt":
        cmd += ["--steps", str(steps if steps is not None else gpt_steps)]
    return cmd + (["--compile-cache", cache] if cache else ["--no-compile-cache"])


def timed_run(cmd: list[str]) -> tuple[float, float | None]:
    """(wall seconds of the process, the loop's own seconds from the summary line)."""
    # The runs measure jaxnn's cache as each variant sets it: a cache jax was pointed at directly would win over it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAXNN_COMPILE_CACHE"))}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    loop = re.search(r", ([0-9.]+) s -> ", proc.stdout)
    return wall, float(loop.group(1)) if loop else None


def measure(model: str, rounds: int, gpt_steps: int, tmp: str, steps: int | None = None) -> dict:
    run_dir = os.path.join(tmp, f"run-{model}")
    warm = os.path.join(tmp, f"warm-{model}")
    timed_run(train_cmd(model, run_dir, warm, gpt_steps, steps))  # fills the warm cache
    times: dict[str, list[float]] = {"cold": [], "warm": [], "off": [], "import": []}
    loops: dict[str, list[float]] = {"cold": [], "warm": [], "off": []}
    for r in range(rounds):
        cold = os.path.join(tmp, f"cold-{model}-{r}")
        for variant, cache in (("cold", cold), ("warm", warm), ("off", None)):
            wall, loop = timed_run(train_cmd(model, run_dir, cache, gpt_steps, steps))
            times[variant].append(wall)
            if loop is not None:
                loops[variant].append(loop)
        shutil.rmtree(cold, ignore_errors=True)
        times["import"].append(timed_run([sys.executable, "-c", IMPORT_ONLY])[0])
    row = {"model": model, **{f"{k}_s": statistics.median(v) for k, v in times.items()}}
    row.update({f"{k}_loop_s": statistics.median(v) for k, v in loops.items() if v})
    row["cold_over_warm"] = row["cold_s"] / row["warm_s"]
    row["cache_mb"] = sum(e.stat().st_size for e in os.scandir(warm) if e.is_file()) / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "gpt"], choices=("mlp", "cnn", "resnet", "gpt"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpt-steps", type=int, default=50)
    parser.add_argument("--steps", type=int, default=None, help="steps of every model's run (default: its own)")
    add_json_flags(parser)
    args = parser.parse_args()
    refuse_existing(args.json, overwrite=args.overwrite)
    with tempfile.TemporaryDirectory(prefix="jaxnn-startup-") as tmp:
        rows = [measure(m, args.rounds, args.gpt_steps, tmp, args.steps) for m in args.models]
    print(f"jaxnn train start-up, median of {args.rounds} interleaved rounds; {cpu_label()}")
    print(f"{'model':6} {'cold s':>7} {'warm s':>7} {'off s':>7} {'cold/warm':>9} {'import s':>8} {'cache MB':>8}")
    for r in rows:
        print(
            f"{r['model']:6} {r['cold_s']:>7.2f} {r['warm_s']:>7.2f} {r['off_s']:>7.2f} "
            f"{r['cold_over_warm']:>8.2f}x {r['import_s']:>8.2f} {r['cache_mb']:>8.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            meta = {"cpu": cpu_label(), "rounds": args.rounds, "gpt_steps": args.gpt_steps}
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
