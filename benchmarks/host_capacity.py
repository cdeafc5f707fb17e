"""Host feeding capacity (`make bench-input ARGS=--capacity`): the most batches per second the host pipeline
delivers, per core and per backend, set against the step rate each benchmark model would need on an H200.

For each workload (the input of a benchmark model at its benchmark batch size: uint8 32x32x3 images with
random crop and flip for the CNN, 28x28 images for the MLP, byte windows for the GPTs) the host pipeline runs
flat out with nothing else to do, through each backend: inline (the main thread: one core), Grain reader threads
in this process, Grain worker processes. `per core` is batches/s divided by the cores the backend can use here.

The H200 side is a projection, not a measurement: FLOPs of one bf16 training step from XLA's cost analysis of
the lowered step, run at `--mfu` (default 40%) of `--peak-tflops` (default 790, the measured bf16 GEMM peak
taken as the H200's). Cores needed = that step rate / the best per-core batch rate; a 16-core host keeps a model
busy when it needs no more than 16 (less the cores the training process itself needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

from benchmarks.machine import cpu_label

# name -> (benchmark model in benchmarks.train_steps.SPECS, or the GPU check's GPT, and its input)
WORKLOADS = {
    "cnn": {"kind": "images", "shape": (32, 32, 3), "batch": 64, "crop_pad": 4, "flip": True},
    "mlp": {"kind": "images", "shape": (28, 28, 1), "batch": 256, "crop_pad": 0, "flip": False},
    "gpt": {"kind": "text", "batch": 16, "seq_len": 128},
    "gpt-h200": {"kind": "text", "batch": 16, "seq_len": 1024},
}
BACKENDS = {
    "inline": {"backend": "inline"},
    "grain threads=1": {"threads": 1},
    "grain threads=2": {"threads": 2},
    "grain 1 process": {"workers": 1},
    "grain 2 processes": {"workers": 2},
}


def host_data(workload: dict):
    from jaxnn.data.datasets import TextCorpus, make_image_dataset

    rng = np.random.default_rng(0)
    if workload["kind"] == "text":
        corpus = rng.integers(32, 127, 8 << 20, dtype=np.uint8)
        return TextCorpus("random-bytes", corpus[: 7 << 20], corpus[7 << 20 :], num_files=1)
    n = 50_000  # a CIFAR-10 / MNIST-sized training set, so that a batch is a gather from a large array
    x = rng.integers(0, 256, (n, *workload["shape"]), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    return make_image_dataset("uint8", x, y, x[:256], y[:256], num_classes=10, scale=255.0)


def backend_cores(cfg) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cfg.backend == "inline":
        return 1
    return min(cfg.workers or cfg.threads, cores)


def batches_per_s(data, cfg, n: int) -> float:
    from jaxnn.data import TrainBatches, host_iterator

    it = host_iterator(TrainBatches(data, cfg, 0, n + 10), cfg)
    for _ in range(10):  # worker start-up and the first epoch's permutation
        next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - t0)


def h200_steps_per_s(model: str, peak_tflops: float, mfu: float) -> tuple[float, float]:
    """(bf16 training-step FLOPs from XLA's cost analysis, projected steps/s on an H200)."""
    import jax
    import optax

    from benchmarks import train_steps
    from jaxnn import models, train
    from jaxnn.profile.timing import cost_counts

    if model == "gpt-h200":
        g = train_steps.GPU_GPT
        net = models.GPT(
            models.GPTConfig(
                vocab_size=g["vocab"],
                seq_len=g["seq_len"],
                d_model=g["d_model"],
                num_layers=g["num_layers"],
                num_heads=g["num_heads"],
            )
        )
        loss = train.language_model_loss
        batch = {"x": jax.ShapeDtypeStruct((g["batch"], g["seq_len"]), np.int32)}
        batch["y"] = batch["x"]
    else:
        net, loss = train_steps.jaxnn_model(model)
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), train_steps.synthetic_batch(model))
    tx = optax.adam(1e-3)
    state = jax.eval_shape(lambda: train.create_train_state(net, tx, jax.random.key(0), batch["x"].shape, "bf16"))
    lowered = train.make_train_step(net, loss, tx, "bf16").lower(state, batch)
    flops = cost_counts(lowered)[0]
    if not flops:
        raise RuntimeError(f"{model}: XLA gave no FLOP count for its step")
    return flops, mfu * peak_tflops * 1e12 / flops


def measure(args: argparse.Namespace) -> dict:
    from jaxnn.data import PipelineConfig

    rows = []
    for name in args.workloads:
        w = WORKLOADS[name]
        data = host_data(w)
        base = PipelineConfig(
            batch_size=w["batch"],
            crop_pad=w.get("crop_pad", 0),
            flip=w.get("flip", False),
            seq_len=w.get("seq_len", 128),
            buffer=8,
        )
        rates: dict[str, list[float]] = {b: [] for b in args.backends}
        for _ in range(args.repeats):  # interleaved: load from other processes falls on every backend
            for b in args.backends:
                rates[b].append(batches_per_s(data, dataclasses.replace(base, **BACKENDS[b]), args.batches))
        per_backend = {}
        for b in args.backends:
            rate = statistics.median(rates[b])
            cores = backend_cores(dataclasses.replace(base, **BACKENDS[b]))
            per_backend[b] = {"batches_per_s": rate, "per_core": rate / cores}
        best = max(per_backend.values(), key=lambda v: v["per_core"])["per_core"]
        flops, need = h200_steps_per_s(name, args.peak_tflops, args.mfu)
        rows.append(
            {
                "workload": name,
                "input": w,
                "backends": per_backend,
                "best_per_core": best,
                "step_flops": flops,
                "h200_steps_per_s": need,
                "cores_needed": need / best,
            }
        )
        print(f"{name}: best {best:,.0f} batches/s per core; H200 projection {need:,.0f} steps/s", flush=True)
    return {
        "cpu": cpu_label(),
        "peak_tflops": args.peak_tflops,
        "mfu": args.mfu,
        "backends": args.backends,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    names = result["backends"]
    lines = [
        f"host batches/s (median of interleaved repeats) on {result['cpu']}; H200 steps/s PROJECTED at "
        f"{100 * result['mfu']:.0f}% of {result['peak_tflops']:.0f} TFLOP/s bf16",
        "| workload | " + " | ".join(names) + " | best per core | step GFLOP | H200 steps/s (proj.) | cores needed |",
        "|---|" + "---|" * (len(names) + 4),
    ]
    for r in result["rows"]:
        cells = [f"{r['backends'][b]['batches_per_s']:,.0f}" for b in names]
        lines.append(
            f"| {r['workload']} | " + " | ".join(cells) + f" | {r['best_per_core']:,.0f} | "
            f"{r['step_flops'] / 1e9:,.1f} | {r['h200_steps_per_s']:,.0f} | {r['cores_needed']:,.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline --capacity", description=__doc__)
    parser.add_argument("--capacity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--batches", type=int, default=200, help="timed batches per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved measurements per backend (median)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="H200 bf16 peak assumed, TFLOP/s")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak a training step reaches")
    parser.add_argument("--out", default="runs/bench-input-capacity.json")
    args = parser.parse_args(argv)
    result = measure(args)
    print(format_table(result))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0
