"""Claims 3 and 6 in training: fp32 against bf16 (and fp16 with dynamic loss scaling, and TF32 on a GPU) for the
CNN on the bundled digits and the GPT on a byte corpus (the Python standard library's sources).

Each precision trains the same model from the same initial key on the same batches; figures: the loss curve,
the final test accuracy (CNN) or test loss in bits per byte (GPT), the wall time of the run, the step time
(median and spread of one compiled step on a batch already on the device), and where that step's device time goes
(`jaxnn.profile.kernel_table`: its slowest operations and the share of each kind).
"""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np

from experiments import common
from jaxnn.data import PipelineConfig, TrainBatches, eval_batches, load_digits, load_text
from jaxnn.data.preprocess import normalise
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig
from jaxnn.profile.kernel_table import step_breakdown
from jaxnn.profile.timing import time_fn
from jaxnn.train import (
    classification_loss,
    language_model_loss,
    make_eval_step,
    make_optimizer,
    make_predict,
    make_train_step,
)

NAME = "exp_train"

CONFIG = {
    "tiny": {
        "cnn": CNNConfig(widths=(4,)),
        "cnn_batch": 16,
        "cnn_steps": 3,
        "gpt": GPTConfig(seq_len=16, d_model=32, num_layers=1, num_heads=2),
        "gpt_batch": 4,
        "gpt_steps": 3,
        "precisions": ["fp32", "bf16"],
        "gpt_precisions": ["fp16"],
        "text_bytes": 1 << 16,
    },
    "quick": {
        "cnn": CNNConfig(widths=(16, 32)),
        "cnn_batch": 64,
        "cnn_steps": 100,
        "gpt": GPTConfig(seq_len=64, d_model=128, num_layers=2, num_heads=4),
        "gpt_batch": 16,
        "gpt_steps": 60,
        "precisions": ["fp32", "bf16", "fp16"],
        "text_bytes": 2 << 20,
    },
    "full": {
        "cnn": CNNConfig(),
        "cnn_batch": 128,
        "cnn_steps": 400,
        "gpt": GPTConfig(),
        "gpt_batch": 32,
        "gpt_steps": 400,
        "precisions": ["fp32", "bf16", "fp16"],
        "text_bytes": 8 << 20,
    },
    "gpu": {
        "cnn": CNNConfig(widths=(64, 128, 256)),
        "cnn_batch": 256,
        "cnn_steps": 300,
        "gpt": GPTConfig(seq_len=256, d_model=512, num_layers=6, num_heads=8),
        "gpt_batch": 64,
        "gpt_steps": 200,
        "precisions": ["fp32", "tf32", "bf16", "fp16"],
        "text_bytes": 8 << 20,
    },
}
LR = {"cnn": 3e-3, "gpt": 1e-3}


def _train_one(model_name, model, data, cfg, precision, steps, batch, repeats):
    pc = PipelineConfig(batch_size=batch, seq_len=getattr(cfg, "seq_len", 128), backend="inline")
    source = TrainBatches(data, pc)
    loss_fn = classification_loss if model_name == "cnn" else language_model_loss
    tx = make_optimizer(LR[model_name], total_steps=steps, warmup_steps=min(steps // 10, 20))
    first = source.batch(0)
    in_shape = first["x"].shape
    # Committed to the device like the states the step returns (else the step compiles twice), and no donation so
    # the same step can be timed on a fixed state afterwards without a second compilation.
    state = common.init_train_state(model, tx, in_shape, precision)
    step = make_train_step(model, loss_fn, tx, precision, donate=False)
    # Placed up front (this experiment measures precision, not input): the loop and the timing below then pass
    # the step the same committed arrays, so it compiles once.
    batches = [
        jax.device_put({k: v for k, v in source.batch(i).items() if k in ("x", "y")}, jax.devices()[0])
        for i in range(steps)
    ]
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])  # device arrays: reading them every step would make the device wait
    losses = [float(x) for x in jax.device_get(losses)]
    wall = time.perf_counter() - t0
    timing = time_fn(lambda: step(state, batches[0])[1]["loss"], repeats=repeats)
    # Where the step's device time goes, by operation and kind, for the bf16 and fp32 rows the claim compares: the
    # figures that say why one precision's step is as fast as it is (a trace of two more steps, dropped after).
    kernels = {}
    if precision in ("bf16", "fp32"):
        with tempfile.TemporaryDirectory(prefix="exp-train-trace-") as trace_dir:
            kernels = step_breakdown(lambda: step(state, batches[0]), None, trace_dir, top=12)
        kernels.pop("trace", None)
    result = {
        "precision": precision,
        "model": model_name,
        "steps": steps,
        "batch": batch,
        "losses": losses,
        "final_train_loss": float(np.mean(losses[-max(1, steps // 10) :])),
        "wall_s": wall,
        "step": timing.as_dict(),
        "step_ms": timing.median * 1e3,
        "finite": bool(np.all(np.isfinite(losses))),
        **({"kernels": kernels} if kernels else {}),
    }
    if precision == "fp16":
        result["final_loss_scale"] = float(state.loss_scale.scale)
    if model_name == "cnn":
        predict = make_predict(model, precision)
        x_test = normalise(data.x_test, data.scale, data.mean, data.std)
        logits = np.asarray(predict(state.params, state.model_state, x_test))
        result["test_accuracy"] = float(np.mean(np.argmax(logits, -1) == data.y_test))
    else:
        evaluate = make_eval_step(model, loss_fn, precision)
        evals = [evaluate(state, b) for b in eval_batches(data, batch, seq_len=cfg.seq_len, max_text_batches=4)]
        result["test_bits_per_byte"] = float(np.mean([float(e["bits_per_token"]) for e in evals]))
    return result


# The rows in the order they run: the ones that decide claim 3 first (bf16 against fp32, the GPT before the CNN:
# its matmuls are what tensor cores speed up), then fp16 and TF32. A budget that runs out skips from the end.
PRIORITY = [
    ("gpt", "bf16"),
    ("gpt", "fp32"),
    ("cnn", "bf16"),
    ("cnn", "fp32"),
    ("gpt", "fp16"),
    ("cnn", "fp16"),
    ("gpt", "tf32"),
    ("cnn", "tf32"),
]
# The first rows always run, however little budget is left: without both of a model's bf16 and fp32 rows the
# experiment decides nothing, and gpu-check skips an experiment whose budget is gone before it starts.
DECISIVE_ROWS = 2


def planned_rows(cfg: dict) -> list[tuple[str, str]]:
    """(model, precision) pairs of a size preset, in PRIORITY order."""
    wanted = {(m, p) for m in ("cnn", "gpt") for p in cfg.get(f"{m}_precisions", cfg["precisions"])}
    return [row for row in PRIORITY if row in wanted]


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Trains each model in each precision on identical batches; loss curves, final quality and speed."""
    budget = budget or common.Budget(None)
    cfg = common.preset(CONFIG, size)
    repeats = 3 if size == "tiny" else 5
    datasets = {"cnn": load_digits(), "gpt": load_text(max_bytes=cfg["text_bytes"])}
    models = {"cnn": CNN(cfg["cnn"]), "gpt": GPT(cfg["gpt"])}
    rows, failures = [], []
    for i, (model_name, precision) in enumerate(planned_rows(cfg)):
        if i >= DECISIVE_ROWS and budget.over():
            budget.skip(f"{model_name} {precision}")
            continue
        try:
            rows.append(
                _train_one(
                    model_name,
                    models[model_name],
                    datasets[model_name],
                    cfg[model_name],
                    precision,
                    cfg[f"{model_name}_steps"],
                    cfg[f"{model_name}_batch"],
                    repeats,
                )
            )
        except Exception as err:  # a precision the backend cannot compile or run is a finding, not a crash
            failures.append(
                {
                    "model": model_name,
                    "precision": precision,
                    "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
                }
            )
    return {
        "rows": rows,
        "failures": failures,
        "configs": {m: vars(cfg[m]) for m in ("cnn", "gpt")},
        "data": {"cnn": datasets["cnn"].name, "gpt": f"{datasets['gpt'].name} ({len(datasets['gpt'].train)} bytes)"},
    }


def summary(record: dict) -> dict:
    """Per model: each precision's step time, speedup over fp32, and final quality next to fp32's."""
    out = {}
    for r in record["rows"]:
        m = out.setdefault(r["model"], {})
        m[r["precision"]] = {
            "step_ms": r["step_ms"],
            "finite": r["finite"],
            "quality": r.get("test_accuracy", r.get("test_bits_per_byte")),
            "quality_name": "test accuracy" if "test_accuracy" in r else "test bits/byte",
        }
    for m in out.values():
        if "fp32" in m:
            for p in m.values():
                p["speedup"] = m["fp32"]["step_ms"] / p["step_ms"]
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    models = sorted({r["model"] for r in record["rows"]})
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.5 * max(len(models), 1), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in record["rows"] if r["model"] == model]
        for i, r in enumerate(rows):
            ax.plot(
                np.arange(1, len(r["losses"]) + 1),
                r["losses"],
                label=f"{r['precision']} ({r['step_ms']:.1f} ms/step)",
                lw=1,
                **common.curve_style(i, len(r["losses"])),
            )
        ax.set(xlabel="step", ylabel="training loss", title=f"{model} — {record['machine']['tag']}", yscale="log")
        by_precision = {r["precision"]: r["losses"] for r in sorted(rows, key=lambda r: r["precision"] != "fp32")}
        note = common.coincide_note(by_precision)
        if note:  # the curves are drawn over each other: say so, where a reader would otherwise see one line
            ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize=7, va="bottom")
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    lines = [f"{f['model']} {f['precision']:5s} FAILED: {f['error']}" for f in record.get("failures", [])]
    for r in record["rows"]:
        quality = (
            f"test acc {r['test_accuracy']:.3f}"
            if "test_accuracy" in r
            else f"test {r['test_bits_per_byte']:.3f} bits/byte"
        )
        lines.append(
            f"{r['model']} {r['precision']:5s} {r['step_ms']:8.2f} ms/step  final loss "
            f"{r['final_train_loss']:.3f}  {quality}  wall {r['wall_s']:.1f} s"
        )
    return lines


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
