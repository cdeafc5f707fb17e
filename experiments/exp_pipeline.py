"""Claim 5 (split the work): CNN training with image augmentation in three arrangements, as augmentation grows.

- `sync`: the host augments a batch, copies it to the device, runs the step and waits for it; then the next batch.
- `overlapped`: host worker threads augment ahead into a bounded queue, batches are `device_put` two steps ahead,
  and the loop never waits for a step (the loss is read at the end), so host and device work at the same time.
- `device`: raw uint8 images go to the device and the augmentation runs inside the compiled train step.

Augmentation is a random 4-pixel-padded crop, a random flip, scaling to [0, 1] and `cost` passes of a 3x3 box blur,
the knob that makes it more expensive. Figures per arrangement and cost: step time (median and spread over
windows of `steps` steps), samples/s, and the device-idle fraction, 1 - (compute-only step time x steps) / wall
time, where the compute-only time is the same compiled step timed alone on a batch already on the device.
"""

from __future__ import annotations

import collections
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import common
from jaxnn.bench import time_fn
from jaxnn.models import CNN, CNNConfig
from jaxnn.train import classification_loss, create_train_state, make_optimizer, train_step_fn

NAME = "exp_pipeline"

CONFIG = {  # batch, steps per window, blur passes, CNN widths, host worker threads
    "tiny": dict(batch=8, steps=2, costs=[1], widths=(4,), workers=1),
    "quick": dict(batch=64, steps=6, costs=[0, 8, 32], widths=(16, 32), workers=2),
    "full": dict(batch=128, steps=10, costs=[0, 8, 32, 96], widths=(16, 32), workers=2),
    "gpu": dict(batch=256, steps=10, costs=[0, 4, 16, 64], widths=(32, 64, 128), workers=8),
}
IMAGE = (32, 32, 3)
PAD = 4


# ------------------------------------------------------------------------------------------- augmentation, twice

def host_augment(images_u8: np.ndarray, rng: np.random.Generator, cost: int) -> np.ndarray:
    """Crop, flip, scale and blur a uint8 NHWC batch in numpy (the host's share of the work)."""
    b, h, w, _ = images_u8.shape
    padded = np.pad(images_u8, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)), mode="reflect")
    dy, dx = rng.integers(0, 2 * PAD + 1, size=(2, b))
    out = np.stack([padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(b)])
    flip = rng.random(b) < 0.5
    out[flip] = out[flip, :, ::-1]
    x = out.astype(np.float32) / 255.0
    for _ in range(cost):
        p = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
        x = sum(p[:, i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9.0
    return x


def device_augment(images_u8, key, cost: int):
    """The same augmentation in jax, traced into the train step."""
    b, h, w, c = images_u8.shape
    padded = jnp.pad(images_u8, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)), mode="reflect")
    k_off, k_flip = jax.random.split(key)
    offsets = jax.random.randint(k_off, (b, 2), 0, 2 * PAD + 1)
    crop = jax.vmap(lambda img, off: lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, c)))(padded, offsets)
    flip = jax.random.bernoulli(k_flip, 0.5, (b, 1, 1, 1))
    x = jnp.where(flip, crop[:, :, ::-1], crop).astype(jnp.float32) / 255.0

    def blur(_, x):
        p = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
        return sum(p[:, i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9.0

    return lax.fori_loop(0, cost, blur, x) if cost else x


class HostLoader:
    """Worker threads that augment batches ahead into a bounded queue (numpy releases the GIL in its kernels)."""

    def __init__(self, images, labels, batch: int, cost: int, workers: int, depth: int = 4):
        self.images, self.labels, self.batch, self.cost = images, labels, batch, cost
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]
        for t in self.threads:
            t.start()

    def _work(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            idx = rng.integers(0, len(self.images), self.batch)
            item = (host_augment(self.images[idx], rng, self.cost), self.labels[idx])
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def __next__(self):
        return self.queue.get()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def prefetch_to_device(iterator, device, depth: int = 2):
    """Yields batches already `device_put`, `depth` ahead, so the copy overlaps the running step."""
    buf = collections.deque()
    while True:
        while len(buf) < depth:
            x, y = next(iterator)
            buf.append({"x": jax.device_put(x, device), "y": jax.device_put(y, device)})
        yield buf.popleft()


# ------------------------------------------------------------------------------------------- the measurement

def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Step time, samples/s and device-idle fraction of each arrangement as augmentation cost grows."""
    budget = budget or common.Budget(None)
    cfg = common.preset(CONFIG, size)
    batch, steps = cfg["batch"], cfg["steps"]
    repeats = 3
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(max(4 * batch, 256), *IMAGE), dtype=np.uint8)
    labels = rng.integers(0, 10, size=len(images)).astype(np.int32)
    model = CNN(CNNConfig(widths=cfg["widths"]))
    tx = make_optimizer(1e-3)
    # Committed to the device like the states the step returns, so the step compiles once, not twice.
    state = jax.device_put(create_train_state(model, tx, jax.random.key(0), (batch, *IMAGE)), device)
    base_step = train_step_fn(model, classification_loss, tx)
    plain_step = jax.jit(base_step)

    def make_device_step(cost):
        def step(state, raw):
            key = jax.random.fold_in(jax.random.key(1), state.step)
            return base_step(state, {"x": device_augment(raw["x"], key, cost), "y": raw["y"]})
        return jax.jit(step)

    # The compute-only step time: what the device must do per step whatever the arrangement.
    placed = {"x": jax.device_put(host_augment(images[:batch], rng, 0), device),
              "y": jax.device_put(labels[:batch], device)}
    compute_only = time_fn(lambda: plain_step(state, placed)[1]["loss"], repeats=repeats)
    host_aug = {}
    rows = []
    for cost in cfg["costs"]:
        if budget.over(0.8):
            budget.skip(f"cost={cost}")
            continue
        t_aug = time_fn(lambda: host_augment(images[:batch], rng, cost), warmup=1, repeats=repeats, number=1)
        host_aug[cost] = t_aug.as_dict()
        device_step = make_device_step(cost)
        raw_placed = {"x": jax.device_put(images[:batch], device), "y": jax.device_put(labels[:batch], device)}
        device_compute = time_fn(lambda: device_step(state, raw_placed)[1]["loss"], repeats=repeats)

        def sync():
            s, loss = state, None
            for _ in range(steps):
                idx = rng.integers(0, len(images), batch)
                b = {"x": jax.device_put(host_augment(images[idx], rng, cost), device),
                     "y": jax.device_put(labels[idx], device)}
                s, metrics = plain_step(s, b)
                loss = jax.block_until_ready(metrics["loss"])  # synchronous: wait before preparing the next batch
            return loss

        loader = HostLoader(images, labels, batch, cost, cfg["workers"])
        stream = prefetch_to_device(loader, device)

        def overlapped():
            s, metrics = state, None
            for _ in range(steps):
                s, metrics = plain_step(s, next(stream))
            return metrics["loss"]

        def on_device():
            s, metrics = state, None
            nxt = None
            for i in range(steps):
                idx = rng.integers(0, len(images), batch)
                cur = nxt if nxt is not None else {"x": jax.device_put(images[idx], device),
                                                   "y": jax.device_put(labels[idx], device)}
                idx = rng.integers(0, len(images), batch)
                nxt = {"x": jax.device_put(images[idx], device), "y": jax.device_put(labels[idx], device)}
                s, metrics = device_step(s, cur)
            return metrics["loss"]

        try:
            for arrangement, fn, busy in (("sync", sync, compute_only), ("overlapped", overlapped, compute_only),
                                          ("device", on_device, device_compute)):
                timing = time_fn(fn, warmup=1, repeats=repeats, number=1)
                step_s = timing.median / steps
                rows.append({"arrangement": arrangement, "cost": cost, "batch": batch, "steps": steps,
                             **timing.as_dict(), "step_s": step_s, "samples_per_s": batch / step_s,
                             "compute_step_s": busy.median,
                             "device_idle": max(0.0, 1.0 - busy.median / step_s)})
        finally:
            loader.close()
    return {"rows": rows, "compute_only": compute_only.as_dict(), "host_augment": host_aug,
            "workers": cfg["workers"], "widths": list(cfg["widths"]), "image": list(IMAGE),
            "pipeline_impl": "experiments.exp_pipeline (threads + device_put prefetch)"}


def summary(record: dict) -> dict:
    """Per cost: samples/s and idle fraction per arrangement, the best arrangement, and the best over sync."""
    out = {}
    for r in record["rows"]:
        out.setdefault(r["cost"], {})[r["arrangement"]] = {"samples_per_s": r["samples_per_s"],
                                                           "device_idle": r["device_idle"]}
    for cost, arr in out.items():
        best = max(arr, key=lambda a: arr[a]["samples_per_s"])
        arr["best"] = best
        if "sync" in arr:
            arr["best_over_sync"] = arr[best]["samples_per_s"] / arr["sync"]["samples_per_s"]
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arrangement in ("sync", "overlapped", "device"):
        rows = sorted((r for r in record["rows"] if r["arrangement"] == arrangement), key=lambda r: r["cost"])
        if rows:
            costs = [r["cost"] for r in rows]
            axes[0].plot(costs, [r["samples_per_s"] for r in rows], "-o", label=arrangement)
            axes[1].plot(costs, [r["device_idle"] for r in rows], "-o", label=arrangement)
    axes[0].set(xlabel="augmentation cost (blur passes)", ylabel="samples/s", title=record["machine"]["tag"])
    axes[1].set(xlabel="augmentation cost (blur passes)", ylabel="device-idle fraction", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    return [f"cost {r['cost']:3d} {r['arrangement']:10s} {r['step_s'] * 1e3:8.1f} ms/step "
            f"{r['samples_per_s']:9.0f} samples/s idle {r['device_idle']:.2f}" for r in record["rows"]]


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
