"""Claim 7 (inference): latency (p50, p99) and throughput against batch size for the CNN and the GPT, per backend.

Latency is one real-time request end to end: the input copied from the host to the device, the compiled forward
pass, and the answer copied back, each call timed on its own (`common.latency_samples`). Throughput is
samples per second with the input already on the device and calls queued back to back (`jaxnn.profile.timing.time_fn`),
the batched-serving case.
"""

from __future__ import annotations

import jax
import numpy as np

from experiments import common
from jaxnn.layers.core import init_model
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig
from jaxnn.profile.timing import time_fn
from jaxnn.train import make_predict

NAME = "exp_inference"

MODELS = {
    "tiny": {"cnn": CNNConfig(widths=(4,)), "gpt": GPTConfig().small()},
    "quick": {"cnn": CNNConfig(widths=(16, 32)), "gpt": GPTConfig(seq_len=64, d_model=128, num_layers=2, num_heads=2)},
    "full": {"cnn": CNNConfig(), "gpt": GPTConfig()},
    "gpu": {"cnn": CNNConfig(), "gpt": GPTConfig()},
}
BATCHES = {
    "tiny": {"cpu": [1, 2], "gpu": [1, 2]},
    "quick": {"cpu": [1, 4, 16, 64, 256], "gpu": [1, 4, 16, 64, 256]},
    "full": {"cpu": [1, 4, 16, 64, 256, 1024], "gpu": [1, 4, 16, 64, 256, 1024, 4096]},
    "gpu": {"cpu": [1, 4, 16, 64, 256], "gpu": [1, 4, 16, 64, 256, 1024, 4096]},
}
LATENCY_CALLS = {"tiny": 10, "quick": 30, "full": 100, "gpu": 100}
IMAGE = (32, 32, 3)


def _input(model_name: str, cfg, batch: int, rng: np.random.Generator) -> np.ndarray:
    if model_name == "cnn":
        return rng.standard_normal((batch, *IMAGE)).astype(np.float32)
    return rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)).astype(np.int32)


def decisive_first(batches: list[int]) -> list[int]:
    """Batch 1 (the real-time half of claim 7) and the largest (the batched half) first, then the rest: a budget
    that runs out skips from the end."""
    ordered = sorted(batches)
    return ordered if len(ordered) < 3 else [ordered[0], ordered[-1], *ordered[1:-1]]


def _measure(predict, placed, backend: str, model_name: str, cfg, batch: int, calls: int, repeats: int, rng, budget):
    """One row: single-request latency (host -> device -> host) and batched throughput (inputs on the device)."""
    params, model_state = placed
    device = common.first_device(backend)
    x_host = _input(model_name, cfg, batch, rng)
    x_dev = jax.device_put(x_host, device)
    per_call = max(budget.left() / 40, 1.0) if budget.seconds else None
    lat = common.latency_samples(
        lambda: np.asarray(predict(params, model_state, jax.device_put(x_host, device))),
        calls=calls,
        max_seconds=per_call,
    )
    thr = time_fn(lambda: predict(params, model_state, x_dev), repeats=repeats)
    return {
        "backend": backend,
        "model": model_name,
        "batch": batch,
        "calls": len(lat),
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "min_ms": float(lat.min() * 1e3),
        **thr.as_dict(),
        "samples_per_s": batch / thr.median,
    }


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """p50/p99 latency of single requests and batched throughput for each model, batch size and backend."""
    budget = budget or common.Budget(None)
    repeats = 3 if size == "tiny" else 5
    calls = common.preset(LATENCY_CALLS, size)
    rng = np.random.default_rng(0)
    rows = []
    backends = common.backends_present()
    batches = {b: common.preset(BATCHES, size)["cpu" if b == "cpu" else "gpu"] for b in backends}
    for model_name, cfg in common.preset(MODELS, size).items():
        model = CNN(cfg) if model_name == "cnn" else GPT(cfg)
        in_shape = (1, *IMAGE) if model_name == "cnn" else (1, cfg.seq_len)
        _, params, model_state = init_model(model, jax.random.key(0), in_shape)
        placed = {b: jax.device_put((params, model_state), common.first_device(b)) for b in backends}
        predict = make_predict(model)
        for batch, backend in common.interleaved(batches, decisive_first):
            if budget.over(0.85):
                budget.skip(f"{backend} {model_name} batch={batch}")
                continue
            rows.append(
                _measure(predict, placed[backend], backend, model_name, cfg, batch, calls, repeats, rng, budget)
            )
    configs = {name: vars(cfg) for name, cfg in common.preset(MODELS, size).items()}
    return {"rows": rows, "configs": configs, "image": list(IMAGE)}


def summary(record: dict) -> dict:
    """Per backend and model: batch-1 latency, best throughput and the batch that reaches it; with an accelerator
    and the CPU in one record, which one answers a single request sooner and which serves batches faster."""
    out = {}
    for r in record["rows"]:
        m = out.setdefault(r["backend"], {}).setdefault(r["model"], {"best_samples_per_s": 0})
        if r["batch"] == 1:
            m["batch1_p50_ms"], m["batch1_p99_ms"] = r["p50_ms"], r["p99_ms"]
            m["batch1_samples_per_s"] = r["samples_per_s"]
        if r["samples_per_s"] > m["best_samples_per_s"]:
            m["best_samples_per_s"], m["best_batch"] = r["samples_per_s"], r["batch"]
    for m in (v for per in out.values() for v in per.values()):
        if "batch1_samples_per_s" in m:  # both throughputs measured the same way (time_fn, inputs on the device)
            m["batching_gain"] = m["best_samples_per_s"] / m["batch1_samples_per_s"]
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for backend in sorted({r["backend"] for r in record["rows"]}):
        for model, style in (("cnn", "-o"), ("gpt", "-s")):
            rows = sorted(
                (r for r in record["rows"] if r["backend"] == backend and r["model"] == model), key=lambda r: r["batch"]
            )
            if rows:
                b = [r["batch"] for r in rows]
                (line,) = axes[0].plot(b, [r["p50_ms"] for r in rows], style, label=f"{backend} {model} p50")
                axes[0].plot(
                    b, [r["p99_ms"] for r in rows], ":", color=line.get_color(), label=f"{backend} {model} p99"
                )
                axes[1].plot(b, [r["samples_per_s"] for r in rows], style, label=f"{backend} {model}")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="latency per request (ms)",
        title=f"End-to-end latency — {record['machine']['tag']}",
    )
    axes[1].set(xscale="log", yscale="log", xlabel="batch size", ylabel="samples/s", title="Batched throughput")
    for ax in axes:
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    return [
        f"{r['backend']} {r['model']} batch {r['batch']:5d}: p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  "
        f"{r['samples_per_s']:10.0f} samples/s"
        for r in record["rows"]
    ]


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
