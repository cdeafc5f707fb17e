"""Claim 6 (big data, big batches): training throughput against device count and batch size, for the three
data-parallel forms of `jaxnn.parallel` (`jit` with NamedSharding, `shard_map` with an explicit pmean, `pmap`).

On a CPU the devices are simulated (`configure_cpu_devices`) and share the same cores, so the device-count axis
checks that the forms run and agree, not that they scale; on a GPU machine the count is the number of real GPUs.
The batch-size sweep (one device, `jit` form) is where the "big batches" claim shows: how samples/s grows with the
batch on each backend.
"""

from __future__ import annotations

import jax
import numpy as np

from experiments import common
from jaxnn.models import CNN, MLP, CNNConfig, MLPConfig
from jaxnn.parallel import configure_cpu_devices, create_sharded_state, make_mesh
from jaxnn.profile.timing import time_fn
from jaxnn.train import classification_loss, create_train_state, make_optimizer
from jaxnn.train.data_parallel import FORMS, data_parallel_train_step

NAME = "exp_parallel"

CONFIG = {
    "tiny": {"model": "mlp", "cfg": MLPConfig(hidden=(32,)), "counts": [2], "per_device": 8, "sweep": [8, 16]},
    "quick": {
        "model": "mlp",
        "cfg": MLPConfig(hidden=(512, 512)),
        "counts": [1, 8],
        "per_device": 64,
        "sweep": [16, 64, 256, 1024],
    },
    "full": {
        "model": "cnn",
        "cfg": CNNConfig(widths=(16, 32)),
        "counts": [1, 2, 4, 8],
        "per_device": 64,
        "sweep": [16, 64, 256, 1024],
    },
    "gpu": {
        "model": "cnn",
        "cfg": CNNConfig(),
        "counts": [1, 2, 4, 8],
        "per_device": 256,
        "sweep": [16, 64, 256, 1024, 4096],
    },
}
IMAGE = (32, 32, 3)
SIMULATED_CPU_DEVICES = 8


def _measure(model, form: str, n_devices: int, global_batch: int, repeats: int) -> dict:
    tx = make_optimizer(1e-3)
    mesh = make_mesh(n_devices)
    dp = data_parallel_train_step(model, classification_loss, tx, mesh=mesh, form=form, donate=False)
    # Initialised straight into replicated arrays: one compiled program, not one per initialiser op.
    state = dp.place_state(
        create_sharded_state(lambda: create_train_state(model, tx, jax.random.key(0), (global_batch, *IMAGE)), mesh)
    )
    rng = np.random.default_rng(0)
    batch = dp.place_batch(
        {
            "x": rng.standard_normal((global_batch, *IMAGE)).astype(np.float32),
            "y": rng.integers(0, 10, global_batch).astype(np.int32),
        }
    )
    timing = time_fn(lambda: dp.step(state, batch)[1]["loss"], repeats=repeats)
    loss = float(dp.step(state, batch)[1]["loss"])
    return {
        "form": form,
        "devices": n_devices,
        "global_batch": global_batch,
        **timing.as_dict(),
        "samples_per_s": global_batch / timing.median,
        "first_loss": loss,
    }


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """samples/s for each form and device count at a fixed per-device batch, then against the batch size."""
    budget = budget or common.Budget(None)
    cfg = common.preset(CONFIG, size)
    repeats = 3 if size == "tiny" else 5
    model = CNN(cfg["cfg"]) if cfg["model"] == "cnn" else MLP(cfg["cfg"])
    available = jax.device_count()
    counts = [n for n in cfg["counts"] if n <= available]
    rows, sweep = [], []
    # The batch sweep first: it decides claim 6, while the device-count rows only check the forms on a CPU.
    for batch in cfg["sweep"]:
        if budget.over(0.5):
            budget.skip(f"sweep batch={batch}")
            continue
        sweep.append(_measure(model, "jit", 1, batch, repeats))
    for n in counts:
        for form in FORMS:
            if budget.over(0.9):
                budget.skip(f"{form} x{n}")
                continue
            rows.append(_measure(model, form, n, cfg["per_device"] * n, repeats))
    return {
        "rows": rows,
        "sweep": sweep,
        "model": cfg["model"],
        "model_config": vars(cfg["cfg"]),
        "per_device_batch": cfg["per_device"],
        "devices_available": available,
        "simulated_devices": jax.default_backend() == "cpu" and available > 1,
    }


def summary(record: dict) -> dict:
    """Scaling from 1 device to the most measured, per form (a form measured on one device count only has no
    speed-up: a budget skipped the rest, and 1.00x would read as a finding); the forms' loss agreement; the
    batch-size gain."""
    out = {"scaling": {}, "loss_spread": None}
    for form in {r["form"] for r in record["rows"]}:
        rows = sorted((r for r in record["rows"] if r["form"] == form), key=lambda r: r["devices"])
        if rows and rows[-1]["devices"] > rows[0]["devices"]:
            out["scaling"][form] = {
                "devices": rows[-1]["devices"],
                "speedup": rows[-1]["samples_per_s"] / rows[0]["samples_per_s"],
            }
    one = [r["first_loss"] for r in record["rows"] if r["devices"] == 1]
    if len(one) > 1:
        out["loss_spread"] = max(one) - min(one)
    sweep = sorted(record.get("sweep", []), key=lambda r: r["global_batch"])
    if len(sweep) > 1:
        out["batch_gain"] = {
            "from": sweep[0]["global_batch"],
            "to": sweep[-1]["global_batch"],
            "samples_per_s_from": sweep[0]["samples_per_s"],
            "samples_per_s_to": sweep[-1]["samples_per_s"],
            "gain": sweep[-1]["samples_per_s"] / sweep[0]["samples_per_s"],
        }
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, form in enumerate(FORMS):
        rows = sorted((r for r in record["rows"] if r["form"] == form), key=lambda r: r["devices"])
        if rows:
            style = {**common.curve_style(i, len(rows)), "markevery": None}
            axes[0].plot([r["devices"] for r in rows], [r["samples_per_s"] for r in rows], label=form, **style)
    sim = " (simulated CPU devices)" if record.get("simulated_devices") else ""
    axes[0].set(xlabel="devices" + sim, ylabel="samples/s", title=f"Data parallel — {record['machine']['tag']}")
    sweep = sorted(record.get("sweep", []), key=lambda r: r["global_batch"])
    if sweep:
        axes[1].plot([r["global_batch"] for r in sweep], [r["samples_per_s"] for r in sweep], "-o")
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="batch size (1 device)",
        ylabel="samples/s",
        title=f"{record.get('model', '')} training throughput",
    )
    axes[0].legend(fontsize=8)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    lines = [
        f"{r['form']:9s} x{r['devices']} batch {r['global_batch']:5d}: {r['samples_per_s']:10.0f} samples/s"
        for r in record["rows"]
    ]
    lines += [f"jit x1 batch {r['global_batch']:5d}: {r['samples_per_s']:10.0f} samples/s" for r in record["sweep"]]
    return lines


if __name__ == "__main__":
    # Simulated CPU devices must be asked for before jax starts its backends; a no-op on GPU machines.
    configure_cpu_devices(SIMULATED_CPU_DEVICES)
    common.main(NAME, run, plot, summarize)
