"""`make bench-input`: step time and device-idle fraction, prefetch on and off, as host augmentation gets dearer.

Also compares the host backends (Grain threads, Grain worker processes, inline) at one cost.
`--capacity` measures instead how many batches per second per core the host can deliver at most, against the
step rate each benchmark model would have on an H200 (benchmarks/host_capacity.py).
"""

# The CPU stands in for an accelerator: XLA's threads are pinned to core 0 ("the device") and the host pipeline to
# the other cores, as a GPU machine's host CPU is free while the GPU computes. (`--xla_cpu_multi_thread_eigen=false`
# alone does not do it: XLA's step still used 1.7 cores here, so the host work slowed the step it was meant to
# overlap. Pinning is done with the Linux CPU affinity that XLA's thread pool inherits when it starts.)
#
# For each augmentation cost (crop + flip applied k times per batch) the bench measures the host's time per batch
# `h`, the step alone `S` (one batch reused, `timing.time_fn`), and the wall time per step `W` of a real loop:
#
# - off: batches built inline, no device prefetch, each step waited for (the naive loop);
# - on:  Grain reader threads build batches in the background, DevicePrefetch keeps 2 batches on the device,
#        metrics are read one step late.
#
# device idle = max(W - S, 0) / W (the part of each step's wall time the device had no work); the pipeline's own
# report, the loop's input wait / W, is printed too. The host-backend comparison backs the choice in docs/data.md.

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

HOST_CORES: set[int] = set()  # the cores left to the host pipeline once XLA has core 0 (empty: not pinned)

CAPACITY = "--capacity" in sys.argv  # the capacity mode uses every core for the host and leaves XLA alone

# Before jax starts: one XLA thread, one device, XLA's thread pool on core 0 only.
if __name__ == "__main__" and not CAPACITY:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=1"
    ).strip()
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        _cores = sorted(os.sched_getaffinity(0))
        HOST_CORES = set(_cores[1:])
        os.sched_setaffinity(0, {_cores[0]})


def _start_device_then_free_host_cores() -> str:
    """Starts XLA while this thread is pinned to one core, so that its thread pool is sized to and stays on that
    core; then moves this thread (and so every host thread and process started later) to the other cores."""
    import jax
    import jax.numpy as jnp

    jax.block_until_ready(jnp.ones((64, 64)) @ jnp.ones((64, 64)))
    if not HOST_CORES:
        return "XLA not pinned (needs Linux and 2 or more cores)"
    device_core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, HOST_CORES)
    return f"XLA pinned to core {device_core}, host on cores {sorted(HOST_CORES)}"


class SleepyBatches:
    """A TrainBatches whose batches also take `delay_s` of waiting (like file or network reads): host cost that
    needs no core, which separates the pipeline's overlap from the competition for this machine's two cores."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.inner[i]


def make_source(data, cfg, start, stop, kind, k, unit):
    from jaxnn.data import TrainBatches

    if kind == "numpy":
        return TrainBatches(data, dataclasses.replace(cfg, augment_repeats=k), start, stop)
    return SleepyBatches(TrainBatches(data, cfg, start, stop), k * unit)


def host_time(source, steps) -> float:
    t0 = time.perf_counter()
    for s in steps:
        source[s]
    return (time.perf_counter() - t0) / len(steps)


def run_loop(step_fn, state, source, cfg, *, prefetch: bool, n: int):
    """Wall seconds per step and input-wait seconds per step over `n` steps (after one warm-up step)."""
    import jax

    from jaxnn.data import DevicePrefetch, host_iterator

    pcfg = cfg if prefetch else dataclasses.replace(cfg, backend="inline")
    batches = DevicePrefetch(host_iterator(source, pcfg), None, 2 if prefetch else 0)
    state, m = step_fn(state, next(batches))
    jax.block_until_ready(m)
    batches.take_wait()
    pending = None
    t0 = time.perf_counter()
    for _ in range(n):
        state, m = step_fn(state, next(batches))
        if prefetch:  # read the previous step's metrics: the device always has the next step queued
            if pending is not None:
                jax.device_get(pending["loss"])
            pending = m
        else:
            jax.device_get(m["loss"])
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t0) / n
    return state, wall, batches.take_wait() / n


def main(argv=None) -> int:
    if "--capacity" in (sys.argv[1:] if argv is None else argv):
        from benchmarks import host_capacity

        return host_capacity.main(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per setting (median reported)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size")
    parser.add_argument("--out", default="runs/bench-input.json", help="where to write the numbers (JSON)")
    parser.add_argument(
        "--fractions",
        default="0.1,0.5,0.9,2.0",
        help="host costs to measure, as fractions of the step's time (comma-separated)",
    )
    args = parser.parse_args(argv)

    pinning = _start_device_then_free_host_cores()
    import jax

    from jaxnn.data import PipelineConfig, TrainBatches, synthetic
    from jaxnn.models import CNN, CNNConfig
    from jaxnn.profile.timing import stepper, time_fn
    from jaxnn.train import create_train_state, make_optimizer, make_train_step, masked_classification_loss

    data = synthetic((32, 32, 3), n_train=4096, n_test=64)
    model = CNN(CNNConfig(widths=(8, 16, 32)))
    tx = make_optimizer(1e-3, total_steps=10_000)
    state = create_train_state(model, tx, jax.random.key(0), (args.batch_size, 32, 32, 3))
    step_fn = make_train_step(model, masked_classification_loss, tx)
    base = PipelineConfig(batch_size=args.batch_size, crop_pad=4, flip=True, threads=1, buffer=4)

    fixed = jax.device_put(TrainBatches(data, base)[0])
    one_step = stepper(step_fn, state, fixed)
    step_s = time_fn(one_step, warmup=3, repeats=7, number=5).median
    state = one_step.state
    unit = host_time(TrainBatches(data, base), range(1000, 1020))
    print(
        f"step alone: {1e3 * step_s:.1f} ms; host crop+flip x1: {1e3 * unit:.2f} ms per batch of "
        f"{args.batch_size} 32x32x3 images; {pinning}"
    )
    # Costs chosen so host time per batch spans about 0.1x to 2.5x the step.
    ks = sorted({max(1, round(float(f) * step_s / unit)) for f in args.fractions.split(",")})
    rows = []
    start = 0
    for kind in ("numpy", "sleep"):
        print(f"host cost = {'crop+flip k times (CPU work)' if kind == 'numpy' else 'k x crop+flip time of sleep'}")
        print(
            f"{'k':>4} {'host ms':>8} {'step ms':>8} | {'off: wall ms':>12} {'idle':>6} {'wait':>6} | "
            f"{'on: wall ms':>11} {'idle':>6} {'wait':>6} | host < step: on-idle < 5%?"
        )
        for k in ks:
            h = host_time(make_source(data, base, 2000, 2010, kind, k, unit), range(10))
            res, steps_alone = {}, []
            for _ in range(args.repeats):
                # The step alone, re-timed next to each loop: other users' load on this machine drifts by 2x.
                one_step.state = state
                steps_alone.append(time_fn(one_step, warmup=1, repeats=3, number=3).median)
                state = one_step.state
                for prefetch in (False, True):  # interleaved, so machine load drifts hit both alike
                    start += args.steps + 8
                    source = make_source(data, base, start, start + args.steps + 8, kind, k, unit)
                    state, wall, wait = run_loop(step_fn, state, source, base, prefetch=prefetch, n=args.steps)
                    res.setdefault(prefetch, []).append((wall, wait))
            step_s = statistics.median(steps_alone)
            row = {"kind": kind, "k": k, "host_s": h, "step_s": step_s}
            for prefetch, name in ((False, "off"), (True, "on")):
                wall = statistics.median(w for w, _ in res[prefetch])
                wait = statistics.median(w for _, w in res[prefetch])
                row[name] = {"wall_s": wall, "idle_frac": max(wall - step_s, 0.0) / wall, "wait_frac": wait / wall}
            verdict = ("yes" if row["on"]["idle_frac"] < 0.05 else "NO") if h < step_s else "(host slower)"
            rows.append(row)
            print(
                f"{k:>4} {1e3 * h:>8.1f} {1e3 * step_s:>8.1f} | {1e3 * row['off']['wall_s']:>12.1f} "
                f"{100 * row['off']['idle_frac']:>5.1f}% {100 * row['off']['wait_frac']:>5.1f}% | "
                f"{1e3 * row['on']['wall_s']:>11.1f} {100 * row['on']['idle_frac']:>5.1f}% "
                f"{100 * row['on']['wait_frac']:>5.1f}% | {verdict}"
            )

    # Host backends at the cost nearest 0.8x the step, all with device prefetch 2.
    k = ks[min(1, len(ks) - 1)]
    backends = {
        "grain threads=1": {"threads": 1},
        "grain threads=2": {"threads": 2},
        "grain 1 process": {"workers": 1},
        "grain 2 processes": {"workers": 2},
        "inline (main thread)": {"backend": "inline"},
    }
    print(f"host backends at numpy cost k={k} (wall ms per step, prefetch 2; median of {args.repeats}):")
    compare = {}
    for name, kw in backends.items():
        cfg = dataclasses.replace(base, augment_repeats=k, **kw)
        walls = []
        for _ in range(args.repeats):
            start += args.steps + 8
            source = TrainBatches(data, cfg, start, start + args.steps + 8)
            state, wall, _ = run_loop(step_fn, state, source, cfg, prefetch=True, n=args.steps)
            walls.append(wall)
        compare[name] = statistics.median(walls)
        print(f"  {name:<22} {1e3 * compare[name]:7.1f} ms  (spread {1e3 * min(walls):.1f}-{1e3 * max(walls):.1f})")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"rows": rows, "backends": compare, "backend_k": k, "batch_size": args.batch_size, "pinning": pinning},
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
