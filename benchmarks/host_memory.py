"""Host memory between steps: the benchmark models' jaxnn steps under jaxnn's default malloc settings, with one
arena (JAXNN_MALLOC=one-arena), with glibc's malloc (and XLA's flags) left as they are (JAXNN_MALLOC=0) and with
glibc's huge pages for large blocks instead (JAXNN_MALLOC=0 GLIBC_TUNABLES=glibc.malloc.hugetlb=1);
jaxnn/_src/malloc.py. Each run is a process of its own; the settings take turns in every round.

    python -m benchmarks.host_memory [--models cnn gpt] [--precisions fp32 bf16] [--rounds 3] [--steps 10]
        [--warmup 10]

Per row, each a median over the rounds: ms per step, the minor page faults and system CPU time per step (getrusage
over the timed steps), the faults per step of the warm-up steps before them (where a kept heap is first built) and
the process's resident memory after the timed steps (VmRSS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing
from benchmarks.train_steps import PRECISIONS, SPECS

# The environment of each setting's processes.
SETTINGS: dict[str, dict[str, str]] = {
    "jaxnn default": {"JAXNN_MALLOC": "1"},
    # What `jaxnn train` does where its compilation cache is on: malloc kept, XLA's scratch in one block.
    "cache on": {"JAXNN_MALLOC": "1", "XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=-1"},
    # Both: the one block on the main arena, whose heap has no 64 MB limit.
    "one-arena, cache on": {"JAXNN_MALLOC": "one-arena", "XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=-1"},
    "one-arena": {"JAXNN_MALLOC": "one-arena"},
    "left as it is": {"JAXNN_MALLOC": "0"},
    "hugetlb": {"JAXNN_MALLOC": "0", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}

# One child: builds the step as the "jaxnn" peer row does, warms it up, times `steps` steps and reports one JSON line.
_CHILD = """
import json, resource, sys, time
from benchmarks.peers.peer_jaxnn import build  # first: the benchmarks' package sets malloc up before jax starts
import jax
from jaxnn._src import malloc

name, precision, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
call = build(name, precision)
jax.block_until_ready(call())  # compiles
start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(warmup):
    jax.block_until_ready(call())
before, times = resource.getrusage(resource.RUSAGE_SELF), []
for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
after = resource.getrusage(resource.RUSAGE_SELF)
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(json.dumps({
    "step_ms": sorted(times)[len(times) // 2] * 1e3,
    "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
    "sys_ms_per_step": (after.ru_stime - before.ru_stime) / steps * 1e3,
    "warmup_faults_per_step": (before.ru_minflt - start_faults) / max(warmup, 1),
    "rss_mb": rss / 1024,
    "malloc": malloc.status(),
}))
"""


def run_child(name: str, precision: str, setting: str, steps: int, warmup: int) -> dict:
    env = {**os.environ, **SETTINGS[setting]}
    cmd = [sys.executable, "-c", _CHILD, name, precision, str(steps), str(warmup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=["cnn", "gpt"])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them, after the compiling one")
    add_json_flags(parser, "also write the rows here")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    print(f"CPU: {cpu_label()}")
    rows = []
    for name in args.models:
        for precision in args.precisions:
            runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    runs[setting].append(run_child(name, precision, setting, args.steps, args.warmup))
            for setting, results in runs.items():
                row = {"model": name, "precision": precision, "malloc": setting, "rounds": results}
                for key in ("step_ms", "faults_per_step", "sys_ms_per_step", "warmup_faults_per_step", "rss_mb"):
                    row[key] = statistics.median(r[key] for r in results)
                rows.append(row)
                print(
                    f"{name:5} {precision:5} {setting:14} {row['step_ms']:9.2f} ms/step  "
                    f"{row['faults_per_step']:8.0f} faults/step  sys {row['sys_ms_per_step']:6.1f} ms/step  "
                    f"warm-up {row['warmup_faults_per_step']:8.0f} faults/step  RSS {row['rss_mb']:6.0f} MB"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_label(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
