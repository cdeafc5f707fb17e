"""Your own model on a GPU, projected: inference throughput per batch size measured on this CPU, next to the same
program projected onto an H200 (`jaxnn.profile.projection.GpuModel`), and the batch size from which the GPU is
projected to serve more samples per second.

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
from jaxnn.timing import time_fn
from jaxnn.train import make_predict

LABEL = "projected, not measured"


def _input(name: str, cfg, batch: int) -> np.ndarray:
    if name == "gpt":
        return np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.seq_len)).astype(np.int32)
    return np.random.default_rng(0).standard_normal((batch, 28, 28, 1)).astype(np.float32)


def project(name: str, fields: dict, batches: list[int], policy: str = "fp32", repeats: int = 5) -> dict:
    """Per batch: samples/s measured here and projected on the GPU; the batch from which the GPU is projected
    to win at every larger batch measured (None if it never does)."""
    model, cfg = train_default_model(name, fields)
    predict = make_predict(model, policy)
    _, params, state = init_model(model, jax.random.key(0), _input(name, cfg, 1).shape)
    gpu, rows = GpuModel(), []
    for batch in sorted(batches):
        x = jnp.asarray(_input(name, cfg, batch))
        cpu_s = time_fn(lambda x=x: predict(params, state, x), repeats=repeats).median
        out = jax.eval_shape(predict, params, state, x)
        kind = "bf16" if policy == "bf16" else "tf32"
        cost = program_cost(predict, (params, state, x), kind, x.nbytes, float(np.prod(out.shape)) * out.dtype.itemsize)
        rows.append(
            {
                "batch": batch,
                "cpu_samples_per_s": batch / cpu_s,
                "gpu_samples_per_s_projected": batch / gpu.queued_s(cost),
                "gpu_request_ms_projected": gpu.request_s(cost) * 1e3,
            }
        )
    wins = [r["gpu_samples_per_s_projected"] > r["cpu_samples_per_s"] for r in rows]
    from_batch = next((r["batch"] for i, r in enumerate(rows) if all(wins[i:])), None)
    return {"model": name, "fields": fields, "policy": policy, "cpu": common.machine_tag(), "rows": rows,
            "gpu_projected_wins_from_batch": from_batch, "gpu_model": gpu.as_dict()}  # fmt: skip


def table(result: dict) -> list[str]:
    lines = [
        f"{'batch':>6} {'CPU samples/s (measured, ' + result['cpu'] + ')':>50} {'H200 samples/s (' + LABEL + ')':>45}",
    ]
    for r in result["rows"]:
        lines.append(f"{r['batch']:>6} {r['cpu_samples_per_s']:>50,.0f} {r['gpu_samples_per_s_projected']:>45,.0f}")
    b = result["gpu_projected_wins_from_batch"]
    lines.append(
        f"the H200 is projected to serve more samples/s from batch {b} ({LABEL})"
        if b is not None
        else f"the H200 is not projected to serve more samples/s at any batch measured ({LABEL})"
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
