"""Claim 5 (split the work): CNN training with image augmentation in three arrangements, as augmentation grows.

Built on the project's own input pipeline (`jaxnn.data`: `TrainBatches`, `host_iterator`, `DevicePrefetch`):
- `sync`: the host computes a batch inline, copies it to the device, runs the step and waits for it; then the next.
- `overlapped`: Grain's reader threads compute batches ahead (inline where Grain is not installed, as on the GPU
  machine; jax's asynchronous dispatch still overlaps that host work with the running step), `DevicePrefetch`
  keeps two batches in flight, and the loop never waits for a step (the loss is read at the end).
- `device`: the host sends normalised but un-augmented batches, and the augmentation runs inside the compiled step.

Augmentation is the pipeline's random crop (zero padding `PAD`) and flip, applied `cost` times
(`PipelineConfig.augment_repeats`): the knob that makes it more expensive. Figures per arrangement and cost: step
time (median and spread over windows of `steps` steps), samples/s, and the device-idle fraction,
1 - (compute-only step time x steps) / wall time, where the compute-only time is the same compiled step timed alone
on a batch already on the device; and the time the loop waited for input (`DevicePrefetch.take_wait`).

`split` measures the real thing beside the synthetic cost: the same random crop and flip in numpy on the host and
inside the step (`jaxnn.augment`, dm-pix), with `experiments.augment_split`: images/s per host core, the
device's extra step time, the input-wait fraction of each placement, the step rate at which host augmentation
stops keeping up, and a projected accelerator row (projected, not measured). Without dm-pix (the GPU machine has
no network to install it) its device rows are skipped with a note.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from experiments import augment_split, common
from experiments.augment_split import IMAGE, PAD
from jaxnn._src.optional import installed
from jaxnn.data import DevicePrefetch, PipelineConfig, TrainBatches, host_iterator, synthetic
from jaxnn.models import CNN, CNNConfig
from jaxnn.profile.timing import time_fn
from jaxnn.train import classification_loss, make_optimizer, train_step_fn

NAME = "exp_pipeline"

CONFIG = {  # batch, steps per window, augmentation repeats, CNN widths, host reader threads, streamed split steps
    "tiny": {"batch": 8, "steps": 2, "costs": [1], "widths": (4,), "threads": 1, "split_steps": 2},
    "quick": {"batch": 64, "steps": 6, "costs": [1, 8, 32], "widths": (16, 32), "threads": 2, "split_steps": 30},
    "full": {"batch": 128, "steps": 10, "costs": [1, 8, 32, 96], "widths": (16, 32), "threads": 2, "split_steps": 60},
    "gpu": {
        "batch": 256,
        "steps": 10,
        "costs": [1, 4, 16, 64],
        "widths": (32, 64, 128),
        "threads": 8,
        "split_steps": 100,
    },
}


def device_augment(x_BHWC, key, repeats: int):
    """The pipeline's crop (zero padding) and flip, `repeats` times, in jax: traced into the train step."""
    b, h, w, c = x_BHWC.shape

    def once(i, x):
        k_off, k_flip = jax.random.split(jax.random.fold_in(key, i))
        padded = jnp.pad(x, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
        offsets = jax.random.randint(k_off, (b, 2), 0, 2 * PAD + 1)
        crop = jax.vmap(lambda img, off: lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, c)))(padded, offsets)
        flip = jax.random.bernoulli(k_flip, 0.5, (b, 1, 1, 1))
        return jnp.where(flip, crop[:, :, ::-1], crop)

    return lax.fori_loop(0, repeats, once, x_BHWC)


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Step time, samples/s and device-idle fraction of each arrangement as augmentation cost grows."""
    budget = budget or common.Budget(None)
    cfg = common.preset(CONFIG, size)
    batch, steps = cfg["batch"], cfg["steps"]
    repeats = 3
    device = jax.devices()[0]
    data = synthetic(IMAGE, n_train=max(8 * batch, 512), n_test=batch)
    model = CNN(CNNConfig(widths=cfg["widths"]))
    tx = make_optimizer(1e-3)
    state = common.init_train_state(model, tx, (batch, *IMAGE), device=device)
    base_step = train_step_fn(model, classification_loss, tx)
    plain_step = jax.jit(base_step)
    overlapped_backend = "grain" if installed("grain") else "inline"

    def pipeline(cost: int, backend: str, augment_on_host: bool = True):
        pc = PipelineConfig(
            batch_size=batch,
            crop_pad=PAD if augment_on_host else 0,
            flip=augment_on_host,
            augment_repeats=cost,
            backend=backend,
            threads=cfg["threads"],
            buffer=4,
        )
        return host_iterator(TrainBatches(data, pc), pc)

    def make_device_step(cost):
        def step(state, batch):
            key = jax.random.fold_in(jax.random.key(1), state.step)
            return base_step(state, {**batch, "x": device_augment(batch["x"], key, cost)})

        return jax.jit(step)

    # The compute-only step time: what the device must do per step whatever the arrangement.
    placed = jax.device_put(next(pipeline(1, "inline")), device)
    compute_only = time_fn(lambda: plain_step(state, placed)[1]["loss"], repeats=repeats)
    host_batch = {}
    rows = []
    for cost in cfg["costs"]:
        if budget.over(0.8):
            budget.skip(f"cost={cost}")
            continue
        probe = TrainBatches(data, PipelineConfig(batch_size=batch, crop_pad=PAD, flip=True, augment_repeats=cost))
        host_batch[cost] = time_fn(lambda: probe.batch(0), warmup=1, repeats=repeats, number=1).as_dict()
        device_step = make_device_step(cost)
        device_compute = time_fn(lambda: device_step(state, placed)[1]["loss"], repeats=repeats)
        sync_iter = pipeline(cost, "inline")
        overlap_iter = DevicePrefetch(pipeline(cost, overlapped_backend), size=2)
        device_iter = DevicePrefetch(pipeline(cost, "inline", augment_on_host=False), size=2)

        def sync():
            s, loss = state, None
            for _ in range(steps):
                s, metrics = plain_step(s, jax.device_put(next(sync_iter), device))
                loss = jax.block_until_ready(metrics["loss"])  # synchronous: wait before preparing the next batch
            return loss

        def streamed(iterator, step_fn):
            def loop():
                s, metrics = state, None
                for _ in range(steps):
                    s, metrics = step_fn(s, next(iterator))
                return metrics["loss"]

            return loop

        for arrangement, fn, busy, waits in (
            ("sync", sync, compute_only, None),
            ("overlapped", streamed(overlap_iter, plain_step), compute_only, overlap_iter),
            ("device", streamed(device_iter, device_step), device_compute, device_iter),
        ):
            timing = time_fn(fn, warmup=1, repeats=repeats, number=1)
            step_s = timing.median / steps
            input_wait = waits.take_wait() / (waits.batches * step_s) if waits and waits.batches else None
            rows.append(
                {
                    "arrangement": arrangement,
                    "cost": cost,
                    "batch": batch,
                    "steps": steps,
                    **timing.as_dict(),
                    "step_s": step_s,
                    "samples_per_s": batch / step_s,
                    "compute_step_s": busy.median,
                    "device_idle": max(0.0, 1.0 - busy.median / step_s),
                    "input_wait_fraction": input_wait,
                }
            )
    split = None
    if budget.over(0.9):
        budget.skip("split")
    else:
        tiny = size == "tiny"
        split = augment_split.measure(
            batch=batch,
            widths=tuple(cfg["widths"]),
            steps=cfg["split_steps"],
            repeats=1 if tiny else repeats,
            number=1 if tiny else 10,
        )
        split["cores"] = common.cpu_cores()
    return {
        "rows": rows,
        "split": split,
        "compute_only": compute_only.as_dict(),
        "host_batch": host_batch,
        "threads": cfg["threads"],
        "widths": list(cfg["widths"]),
        "image": list(IMAGE),
        "overlapped_backend": overlapped_backend,
        "pipeline_impl": "jaxnn.data (TrainBatches, host_iterator, DevicePrefetch)",
    }


def summary(record: dict) -> dict:
    """Per cost: samples/s and idle fraction per arrangement, the best arrangement, and the best over sync."""
    out = {}
    for r in record["rows"]:
        out.setdefault(r["cost"], {})[r["arrangement"]] = {
            "samples_per_s": r["samples_per_s"],
            "device_idle": r["device_idle"],
        }
    for arr in out.values():
        best = max(arr, key=lambda a: arr[a]["samples_per_s"])
        arr["best"] = best
        if "sync" in arr:
            arr["best_over_sync"] = arr[best]["samples_per_s"] / arr["sync"]["samples_per_s"]
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, arrangement in enumerate(("sync", "overlapped", "device")):
        rows = sorted((r for r in record["rows"] if r["arrangement"] == arrangement), key=lambda r: r["cost"])
        if rows:
            costs = [r["cost"] for r in rows]
            style = {**common.curve_style(i, len(rows)), "markevery": None}
            axes[0].plot(costs, [r["samples_per_s"] for r in rows], label=arrangement, **style)
            axes[1].plot(costs, [r["device_idle"] for r in rows], label=arrangement, **style)
    axes[0].set(xlabel="augmentation cost (blur passes)", ylabel="samples/s", title=record["machine"]["tag"])
    axes[1].set(xlabel="augmentation cost (blur passes)", ylabel="device-idle fraction", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    lines = [
        f"cost {r['cost']:3d} {r['arrangement']:10s} {r['step_s'] * 1e3:8.1f} ms/step "
        f"{r['samples_per_s']:9.0f} samples/s idle {r['device_idle']:.2f}"
        for r in record["rows"]
    ]
    if record.get("split"):
        lines += augment_split.format_table(record["split"]).splitlines()
    return lines


def split_line(split: dict) -> dict:
    """Where host crop+flip stops keeping up: measured here, and at the projected accelerator step rate.

    `keeps_up_here`: the host's cores prepare augmented batches at least as fast as the in-step placement trains;
    `keeps_up_projected`: the projected accelerator's step rate needs no more host cores than this machine has."""
    cores = split.get("cores") or 1
    line = split["host_keeps_up_to_steps_per_s_per_core"]
    out: dict = {"steps_per_s_per_core": line, "cores": cores, "batch": split["batch"]}
    if "in_step" in split:
        out["keeps_up_here"] = line * cores >= split["in_step"]["steps_per_s"]
        needed = split["projected"]["host_cores_needed"]
        out["cores_needed_projected"] = needed
        out["keeps_up_projected"] = needed is not None and needed <= cores
    return out


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
