"""`make experiments`: every experiment in turn, each in its own process, with a progress bar over them.

A process per experiment because exp_parallel must ask for simulated CPU devices before jax starts, and so that a
hung or crashed experiment is stopped at its hard time limit without losing the others. Quick-size budgets keep
the whole run under 10 minutes on a 2-core CPU; the report is built afterwards by `make report`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from tqdm import tqdm

from experiments import common
from experiments.gpu_check import BUDGETS as GPU_BUDGETS

ORDER = ["exp_matmul", "exp_precision", "exp_sequential", "exp_pipeline", "exp_inference", "exp_parallel", "exp_train"]
# Soft budgets (seconds) per size; the hard limit per process is twice the budget plus start-up and compilation.
BUDGETS = {
    "tiny": dict.fromkeys(ORDER, 60),
    "quick": {
        "exp_matmul": 50,
        "exp_precision": 45,
        "exp_sequential": 40,
        "exp_pipeline": 75,
        "exp_inference": 70,
        "exp_parallel": 60,
        "exp_train": 110,
    },
    "full": dict.fromkeys(ORDER, 600),
    "gpu": GPU_BUDGETS,  # one table for both entry points: gpu-check's, inside its 8 minutes
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.run_all", description=__doc__)
    parser.add_argument("--size", choices=list(BUDGETS), default="quick")
    parser.add_argument("--out", default="results")
    parser.add_argument("--only", nargs="*", default=None, choices=ORDER, help="run only these experiments")
    common.add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    names = [n for n in ORDER if args.only is None or n in args.only]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    failures = []
    start = time.perf_counter()
    bar = tqdm(names, desc="experiments", unit="exp")
    for name in bar:
        bar.set_postfix_str(name)
        budget = BUDGETS[args.size][name]
        cmd = [
            sys.executable,
            "-m",
            f"experiments.{name}",
            "--size",
            args.size,
            "--out",
            args.out,
            "--budget",
            str(budget),
            *(["--overwrite"] if args.overwrite else []),
        ]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2 * budget + 120)
        except subprocess.TimeoutExpired:
            failures.append(name)
            tqdm.write(f"{name}: stopped at its hard limit of {2 * budget + 120} s")
            continue
        if proc.returncode != 0:
            failures.append(name)
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            tqdm.write(f"{name}: FAILED (exit {proc.returncode}): " + " | ".join(tail))
        else:
            tqdm.write(proc.stdout.rstrip())
    bar.close()
    print(
        f"experiments: {len(names) - len(failures)}/{len(names)} done in {time.perf_counter() - start:.0f} s"
        + (f"; failed: {', '.join(failures)}" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
