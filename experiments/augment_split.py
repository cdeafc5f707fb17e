"""Where random crop and flip run: on the host in numpy, or inside the train step on the device (claim 5's split).

The same augmentation both ways, for the CNN on 32x32x3 images, side by side in one run:
- host: `jaxnn.data` computes each batch (gather, normalise, `random_crop`, `random_flip` in numpy) in one thread,
  `DevicePrefetch` copies it ahead, and the plain step trains on it;
- device: the host computes the same batches without the crop and flip, and the step applies
  `jaxnn.augment.Augment(crop_pad=4, flip=True)` (dm-pix) to them before the forward pass.

Figures: the host's augmentation time per batch and images/s per core (one thread: one core), the device's extra
step time (the augmented step against the plain one, both on a batch already on the device), steps/s and the
input-wait fraction of each placement (the time `next()` waited for a batch / wall time), and the step rate at
which host augmentation stops keeping up: one core prepares `1 / host batch time` batches a second. The projected
accelerator figures come from XLA's cost analysis of the two programs and `jaxnn.profile.projection`'s model (max
of FLOPs / peak and bytes / bandwidth): projected, not measured.

`experiments.exp_pipeline` records these figures as its `split`; `make bench-augment` prints and writes them alone.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np

from experiments import common
from jaxnn._src.optional import installed
from jaxnn.augment import Augment, augment_batch  # dm-pix itself is imported on first use
from jaxnn.data import DevicePrefetch, PipelineConfig, TrainBatches, host_iterator, synthetic
from jaxnn.models import CNN, CNNConfig
from jaxnn.profile.program_cost import program_cost
from jaxnn.profile.projection import GpuModel
from jaxnn.train import classification_loss, create_train_state, make_optimizer, train_step_fn

IMAGE = (32, 32, 3)
PAD = 4


def _median_s(*fns, repeats: int, number: int) -> list[float]:
    """Median seconds per call of each of `fns`, timed in turn within each repeat: load from other processes on a
    shared machine then falls on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            for _ in range(number):
                fn()
            out.append((time.perf_counter() - t) / number)
    return [float(np.median(t)) for t in times]


def measure(
    *, batch: int = 64, widths: tuple[int, ...] = (16, 32), steps: int = 30, repeats: int = 3, number: int = 10
) -> dict:
    """Host against in-step crop+flip on this machine's default device; see the module docstring."""
    data = synthetic(IMAGE, n_train=max(16 * batch, 1024), n_test=batch)
    host_cfg = PipelineConfig(batch_size=batch, crop_pad=PAD, flip=True, backend="inline")
    plain_cfg = PipelineConfig(batch_size=batch, backend="inline")
    host_src, plain_src = TrainBatches(data, host_cfg), TrainBatches(data, plain_cfg)
    result = _host_figures(host_src, plain_src, batch, widths, repeats=repeats, number=number)
    if not installed("dm_pix"):
        result["notes"].append("device rows skipped: dm-pix is not installed (pip install 'jaxnn[augment]')")
        return result
    state0, aug_fn, plain_step, device_step = _steps(batch, widths)
    placed = jax.device_put(plain_src.batch(0))
    step_plain, step_aug = _median_s(
        lambda: jax.block_until_ready(plain_step(state0, placed)[1]["loss"]),
        lambda: jax.block_until_ready(device_step(state0, placed)[1]["loss"]),
        repeats=repeats,
        number=number,
    )
    runs: dict[str, list[dict]] = {"host": [], "in_step": []}
    for _ in range(repeats):  # in turn, as above; the median run of each by steps/s
        runs["host"].append(_streamed(data, host_cfg, plain_step, state0, steps))
        runs["in_step"].append(_streamed(data, plain_cfg, device_step, state0, steps))
    host_run, device_run = (sorted(r, key=lambda v: v["steps_per_s"])[len(r) // 2] for r in runs.values())
    for r in (host_run, device_run):
        r["images_per_s"] = r["steps_per_s"] * batch
    result.update(
        {
            "step_plain_s": step_plain,
            "step_augmented_s": step_aug,
            "device_extra_s": step_aug - step_plain,
            "device_extra_fraction": (step_aug - step_plain) / step_plain,
            "host": host_run,
            "in_step": device_run,
            "projected": _projected(aug_fn, plain_step, state0, placed, result["host_batch_s"]),
        }
    )
    return result


def _host_figures(host_src, plain_src, batch: int, widths: tuple[int, ...], *, repeats: int, number: int) -> dict:
    """The host's side: a batch's time with and without crop+flip, and the step rate one core keeps up with."""
    counter = iter(range(1 << 30))
    with_aug, without = _median_s(
        lambda: host_src.batch(next(counter)),
        lambda: plain_src.batch(next(counter)),
        repeats=repeats,
        number=2 * number,
    )
    host_aug_s = max(with_aug - without, 0.0)
    return {
        "cpu": common.cpu_tag(),
        "device": str(jax.devices()[0].device_kind),
        "batch": batch,
        "widths": list(widths),
        "image": list(IMAGE),
        "augment": f"crop (pad {PAD}) + flip",
        "host_batch_s": with_aug,
        "host_batch_plain_s": without,
        "host_augment_s": host_aug_s,
        "host_images_per_s_per_core": batch / with_aug,
        "host_augment_images_per_s_per_core": batch / host_aug_s if host_aug_s else None,
        # One core keeps up with steps no faster than this; n cores with n times it.
        "host_keeps_up_to_steps_per_s_per_core": 1.0 / with_aug,
        "notes": [],
    }


def _steps(batch: int, widths: tuple[int, ...]) -> tuple[Any, Any, Any, Any]:
    """The first train state, the in-step augmentation, and the jitted plain and augmenting steps of the CNN."""
    model = CNN(CNNConfig(widths=widths))
    tx = make_optimizer(1e-3)
    state0 = jax.jit(lambda k: create_train_state(model, tx, k, (batch, *IMAGE)))(jax.random.key(0))
    aug_fn = functools.partial(augment_batch, Augment(crop_pad=PAD, flip=True))
    plain_step = jax.jit(train_step_fn(model, classification_loss, tx))
    device_step = jax.jit(train_step_fn(model, classification_loss, tx, augment=aug_fn))
    return state0, aug_fn, plain_step, device_step


def _streamed(data, cfg, step_fn, state0, steps: int) -> dict:
    """Steps/s and input-wait fraction of `steps` steps streamed as fit runs them: batches copied ahead, the loss
    read only at the end."""
    prefetch = DevicePrefetch(host_iterator(TrainBatches(data, cfg, 0, steps + 1), cfg), size=2)
    state, metrics = step_fn(state0, next(prefetch))
    jax.block_until_ready(metrics["loss"])
    prefetch.take_wait()
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step_fn(state, next(prefetch))
    jax.block_until_ready(metrics["loss"])
    wall = time.perf_counter() - t
    return {"steps_per_s": steps / wall, "input_wait_fraction": prefetch.take_wait() / wall}


def _projected(aug_fn, plain_step, state0, placed, with_aug: float) -> dict:
    """The GPU model of REPORT.md's projected column (roofline, kernel launches and dispatch, fp32 steps on TF32)
    for the augmentation and the plain step: projected, not measured."""
    gpu = GpuModel()
    aug_cost = program_cost(jax.jit(aug_fn), (placed, state0.key, state0.step, 0), "tf32")
    step_cost = program_cost(plain_step, (state0, placed), "tf32")  # host-augmented batches: the plain step
    # The CPU compiler fuses the per-example crop and flip far less than a GPU compiler would (hundreds of
    # kernels), so the augmentation's device time is given as a range: the roofline alone, and with a launch per
    # kernel the CPU compile has.
    projected_step = gpu.queued_s(step_cost)
    projected_steps_per_s = 1.0 / projected_step
    return {
        "label": "projected, not measured",
        "accelerator": gpu.name,
        "source": "jaxnn.profile.projection.GpuModel (H200_MODEL_SOURCES)",
        "augment_flops": aug_cost.flops,
        "augment_bytes": aug_cost.nbytes,
        "augment_kernels": aug_cost.kernels,
        "device_extra_s": gpu.device_s(aug_cost),
        "device_extra_roofline_s": gpu.roofline_s(aug_cost),
        "step_s": projected_step,
        "steps_per_s": projected_steps_per_s,
        # Host cores that crop and flip fast enough for the projected step rate.
        "host_cores_needed": projected_steps_per_s * with_aug,
    }


def format_table(r: dict) -> str:
    """The record of `measure` as lines: the host's figures, then (with dm-pix) the two placements side by side and
    the projected accelerator row."""
    lines = [
        f"crop+flip placement, CNN {r['widths']} on {r['image'][0]}x{r['image'][1]} images, batch {r['batch']}, "
        f"on {r['cpu']} ({r['device']})",
        f"host: {r['host_batch_s'] * 1e3:.2f} ms per batch with crop+flip ({r['host_augment_s'] * 1e3:.2f} ms of it "
        f"the augmentation): {r['host_images_per_s_per_core']:,.0f} images/s per core, keeps up with at most "
        f"{r['host_keeps_up_to_steps_per_s_per_core']:,.0f} steps/s per core",
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    if "host" not in r:
        return "\n".join(lines)
    p = r["projected"]
    lines += [
        "| placement | steps/s | images/s | input wait | device step |",
        "|---|---|---|---|---|",
        f"| host (numpy) | {r['host']['steps_per_s']:,.1f} | {r['host']['images_per_s']:,.0f} | "
        f"{r['host']['input_wait_fraction']:.0%} | {r['step_plain_s'] * 1e3:.2f} ms |",
        f"| in the step (dm-pix) | {r['in_step']['steps_per_s']:,.1f} | {r['in_step']['images_per_s']:,.0f} | "
        f"{r['in_step']['input_wait_fraction']:.0%} | {r['step_augmented_s'] * 1e3:.2f} ms "
        f"({r['device_extra_fraction']:+.0%}) |",
        f"{p['accelerator']} ({p['source']}): augmentation {p['device_extra_roofline_s'] * 1e6:.2f} us per step "
        f"(roofline) to {p['device_extra_s'] * 1e6:,.0f} us (a launch for each of the CPU compile's "
        f"{p['augment_kernels']} kernels), plain step {p['step_s'] * 1e6:.1f} us; host cores crop+flip needs at "
        f"that step rate: {p['host_cores_needed']:,.1f}",
    ]
    return "\n".join(lines)
