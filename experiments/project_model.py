"""Your own model on a GPU, projected: inference and training throughput per batch size measured on this CPU, next
to the same programs projected onto an H200 (`jaxnn.profile.projection.GpuModel`), the batch sizes from which the
GPU is projected to serve and to train more samples per second, and the latency of one batch-1 request both ways.

    python -m experiments.project_model --model cnn --batches 1 8 64 512 [--field widths=[32,64]] [--json out.json]

The model is any built-in one, with `jaxnn train`'s defaults and `--field`s on top (`jaxnn.models.factory`);
inputs are `jaxnn train`'s shapes (28x28x1 images, or the GPT's context). The GPU figures are projected, not
measured: from XLA's costs of the program compiled here, with the model's assumptions (docs/experiments.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from jaxnn.config import ConfigError
from jaxnn.layers.core import init_model
from jaxnn.models.factory import train_default_model
from jaxnn.profile.program_cost import program_cost
from jaxnn.profile.projection import GpuModel
from jaxnn.profile.timing import time_fn
from jaxnn.train import (
    create_train_state,
    lm_loss,
    make_optimizer,
    make_predict,
    masked_classification_loss,
    train_step_fn,
)

LABEL = "projected, not measured"


def _input(name: str, cfg, batch: int) -> np.ndarray:
    if name == "gpt":
        return np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.seq_len)).astype(np.int32)
    return np.random.default_rng(0).standard_normal((batch, 28, 28, 1)).astype(np.float32)


def _batch(name: str, cfg, batch: int) -> dict:
    """Inputs and labels of `jaxnn train`'s shapes: next-token targets for the GPT, classes for the rest."""
    x = _input(name, cfg, batch)
    if name == "gpt":
        return {"x": jnp.asarray(x), "y": jnp.asarray(np.roll(x, -1, axis=1))}
    y = np.random.default_rng(1).integers(0, getattr(cfg, "num_classes", 10), (batch,)).astype(np.int32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y), "mask": jnp.ones((batch,), bool)}


def _wins_from(rows: list[dict], what: str) -> int | None:
    """The batch from which the GPU is projected to win at every larger batch measured (None if it never does)."""
    wins = [r[f"gpu_{what}_per_s_projected"] > r[f"cpu_{what}_per_s"] for r in rows]
    return next((r["batch"] for i, r in enumerate(rows) if all(wins[i:])), None)


def project(name: str, fields: dict, batches: list[int], policy: str = "fp32", repeats: int = 5) -> dict:
    """Per batch: inference and training samples/s measured here and projected on the GPU (the train step with
    the default optimizer and loss of `jaxnn train`), and the batch from which the GPU is projected to win each."""
    model, cfg = train_default_model(name, fields)
    predict = make_predict(model, policy)
    loss = lm_loss if name == "gpt" else masked_classification_loss
    tx = make_optimizer(1e-3)
    step = jax.jit(train_step_fn(model, loss, tx, policy))
    _, params, state = init_model(model, jax.random.key(0), _input(name, cfg, 1).shape)
    gpu, rows = GpuModel(), []
    kind = "bf16" if policy == "bf16" else "tf32"
    for batch in sorted(batches):
        data = _batch(name, cfg, batch)
        x = data["x"]
        cpu_s = time_fn(lambda x=x: predict(params, state, x), repeats=repeats).median
        out = jax.eval_shape(predict, params, state, x)
        cost = program_cost(predict, (params, state, x), kind, x.nbytes, float(np.prod(out.shape)) * out.dtype.itemsize)
        train_state = create_train_state(model, tx, jax.random.key(0), x.shape, policy)
        train_s = time_fn(lambda d=data, s=train_state: step(s, d), repeats=repeats).median
        train_cost = program_cost(step, (train_state, data), kind)
        rows.append(
            {
                "batch": batch,
                "cpu_samples_per_s": batch / cpu_s,
                "gpu_samples_per_s_projected": batch / gpu.queued_s(cost),
                "cpu_request_ms": cpu_s * 1e3,
                "gpu_request_ms_projected": gpu.request_s(cost) * 1e3,
                "cpu_train_samples_per_s": batch / train_s,
                "gpu_train_samples_per_s_projected": batch / gpu.queued_s(train_cost),
            }
        )
    return {"model": name, "fields": fields, "policy": policy, "cpu": common.machine_tag(), "rows": rows,
            "gpu_projected_wins_from_batch": _wins_from(rows, "samples"),
            "gpu_projected_trains_faster_from_batch": _wins_from(rows, "train_samples"),
            "gpu_model": gpu.as_dict()}  # fmt: skip


def table(result: dict) -> list[str]:
    lines = [
        f"samples/s: CPU measured on {result['cpu']}; H200 {LABEL}",
        f"{'batch':>6} {'infer CPU':>12} {'infer H200':>12} {'train CPU':>12} {'train H200':>12}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['batch']:>6} {r['cpu_samples_per_s']:>12,.0f} {r['gpu_samples_per_s_projected']:>12,.0f} "
            f"{r['cpu_train_samples_per_s']:>12,.0f} {r['gpu_train_samples_per_s_projected']:>12,.0f}"
        )
    first = result["rows"][0]
    lines.append(
        f"one batch-{first['batch']} request: {first['cpu_request_ms']:.3f} ms on the CPU (measured), "
        f"{first['gpu_request_ms_projected']:.3f} ms on the H200 with its copies in and out ({LABEL})"
    )
    for key, what in (("gpu_projected_wins_from_batch", "serve"), ("gpu_projected_trains_faster_from_batch", "train")):
        b = result[key]
        lines.append(
            f"the H200 is projected to {what} more samples/s from batch {b} ({LABEL})"
            if b is not None
            else f"the H200 is not projected to {what} more samples/s at any batch measured ({LABEL})"
        )
    return lines


def _fields(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--field {item!r}: write NAME=VALUE (VALUE as JSON, e.g. widths=[32,64])")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.project_model", description=__doc__)
    parser.add_argument("--model", default="cnn", help="a built-in model name (cnn, gpt, mlp, ...)")
    parser.add_argument("--field", action="append", default=[], metavar="NAME=VALUE", help="a config field")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--policy", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if min(args.batches) < 1:
        parser.error(f"--batches: every batch size must be at least 1, got {min(args.batches)}")
    try:
        result = project(args.model, _fields(args.field), args.batches, args.policy, args.repeats)
    except ConfigError as err:
        print(f"project_model: {err}", file=sys.stderr)
        return 2
    print("\n".join(table(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
