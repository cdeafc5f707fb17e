"""The training loop behind `jaxnn train`: `train(cfg) -> summary` for a frozen TrainConfig.

Host pipeline (jaxnn.data) -> device prefetch onto the batch sharding -> jitted, donated train step
(jaxnn.train) -> metrics read one step late (so the device never waits on the host) -> JSON lines, progress bar,
orbax checkpoints (jaxnn.checkpoint). Errors in the config or the data are raised as `ValueError` subclasses
before anything is written, so the CLI can refuse them with exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import shutil
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MODELS = ("mlp", "cnn", "resnet", "gpt")
SIZES = ("small", "base")
# Config fields that do not change what a run computes: a checkpoint may be resumed with them changed.
RUN_ONLY_FIELDS = ("run_dir", "ckpt_dir", "resume", "overwrite", "devices", "eval_every", "log_every",
                   "ckpt_every", "keep", "prefetch", "backend", "workers", "progress", "plots", "sample_bytes")


class ConfigError(ValueError):
    """A training config that cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. `dataset` "auto": text for gpt, else the format found in `data_dir`, else digits.

    `model_overrides` replaces fields of the model's config, as ((field, value), ...), e.g. (("d_model", 128),).
    """

    model: str = "cnn"
    dataset: str = "auto"
    data_dir: str | None = None
    size: str = "base"
    model_overrides: tuple = ()
    steps: int = 600
    batch_size: int = 64
    precision: str = "fp32"
    lr: float = 3e-3
    warmup: int = 0
    weight_decay: float = 0.0
    seed: int = 0
    crop_pad: int = 0
    flip: bool = False
    seq_len: int = 128
    run_dir: str = "runs/default"
    ckpt_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    devices: int = 1
    eval_every: int = 0  # 0: five evaluations over the run
    log_every: int = 50
    ckpt_every: int = 0  # 0: only at the end (and on a signal)
    keep: int = 3
    prefetch: int = 2
    backend: str = "grain"
    workers: int = 0
    progress: bool = True
    plots: bool = True
    sample_bytes: int = 300

    def small(self) -> "TrainConfig":
        return dataclasses.replace(self, size="small", steps=30, batch_size=16, seq_len=32, log_every=10,
                                   plots=False, progress=False, sample_bytes=32)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model_overrides"] = [list(kv) for kv in self.model_overrides]
        return d

    def trajectory(self) -> dict:
        """The fields that determine the computed parameters (what a resumed run must share)."""
        # Through JSON, so that it compares equal to a saved copy (tuples come back as lists).
        return json.loads(json.dumps({k: v for k, v in self.as_dict().items() if k not in RUN_ONLY_FIELDS}))


def validate(cfg: TrainConfig) -> None:
    """Refuses impossible values up front, one field per message."""
    from jaxnn.precision import PRESETS

    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {list(MODELS)}")
    if cfg.size not in SIZES:
        raise ConfigError(f"unknown size {cfg.size!r}; choose one of {list(SIZES)}")
    if cfg.precision not in PRESETS:
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose one of {sorted(PRESETS)}")
    for name in ("steps", "batch_size", "devices", "log_every", "seq_len", "keep"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"lr must be a positive number, got {cfg.lr!r}")
    for name in ("warmup", "eval_every", "ckpt_every", "prefetch", "workers", "crop_pad", "weight_decay"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.batch_size % cfg.devices:
        raise ConfigError(f"batch size {cfg.batch_size} is not divisible by the {cfg.devices} devices")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")


def resolve_dataset(cfg: TrainConfig) -> str:
    from jaxnn.data import FORMATS, DataError, detect_format

    if cfg.dataset not in FORMATS + ("auto",):
        raise DataError(f"unknown data set {cfg.dataset!r}; choose one of {['auto', *FORMATS]}")
    if cfg.dataset != "auto":
        name = cfg.dataset
    elif cfg.model == "gpt":
        name = "text"
    else:
        name = detect_format(cfg.data_dir) if cfg.data_dir else "digits"
    if (name == "text") != (cfg.model == "gpt"):
        raise ConfigError(f"model {cfg.model!r} cannot train on data set {name!r}: "
                          f"{'gpt needs text' if cfg.model == 'gpt' else 'text needs --model gpt'}")
    if cfg.data_dir and name in ("digits", "synthetic"):
        raise ConfigError(f"data set {name!r} is built in; drop --data {cfg.data_dir}")
    return name


def load_data(cfg: TrainConfig):
    """The data set the config names, checked against the format (a DataError names the file otherwise)."""
    from jaxnn.data import DataError, detect_format, load_dataset

    name = resolve_dataset(cfg)
    if cfg.data_dir and name in ("mnist", "fashion_mnist", "cifar10"):
        found = detect_format(cfg.data_dir)
        if found != ("cifar10" if name == "cifar10" else "mnist"):
            raise DataError(f"{cfg.data_dir}: holds {found} files, not the {name} format")
    return load_dataset(name, cfg.data_dir)


def model_config(cfg: TrainConfig, data):
    from jaxnn.data import TextCorpus
    from jaxnn.models import CONFIGS

    mcfg = CONFIGS[cfg.model]()
    mcfg = mcfg.small() if cfg.size == "small" else mcfg
    fields = {f.name for f in dataclasses.fields(mcfg)}
    overrides = dict(cfg.model_overrides)
    if cfg.model == "gpt":
        overrides.setdefault("seq_len", cfg.seq_len)
    elif not isinstance(data, TextCorpus):
        overrides.setdefault("num_classes", data.num_classes)
    unknown = set(overrides) - fields
    if unknown:
        raise ConfigError(f"model {cfg.model!r} has no config field(s) {sorted(unknown)}; it has {sorted(fields)}")
    return dataclasses.replace(mcfg, **overrides)


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuses to touch a run directory that holds another run, unless --resume or --overwrite says how."""
    run_dir = pathlib.Path(cfg.run_dir)
    saved_path = run_dir / "config.json"
    if cfg.resume or cfg.overwrite or not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if saved_path.is_file():
        from jaxnn.checkpoint import config_differences

        try:
            saved = json.loads(saved_path.read_text())
        except ValueError:
            saved = {}
        diffs = config_differences(saved, cfg.trajectory())
        if diffs:
            raise ConfigError(f"run dir {run_dir} belongs to a different config ({'; '.join(diffs)}); "
                              f"pass --resume or --overwrite, or another --run-dir")
    raise ConfigError(f"run dir {run_dir} already holds a run; pass --resume to continue it, --overwrite to "
                      f"replace it, or another --run-dir")


def masked_classification_loss(logits, batch):
    """Softmax cross-entropy and accuracy over the rows whose `mask` is 1 (padding rows count for nothing)."""
    import jax.numpy as jnp
    import optax

    labels = batch["y"]
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    mask = batch.get("mask", jnp.ones_like(per_example))
    count = jnp.maximum(mask.sum(), 1.0)
    return (per_example * mask).sum() / count, {"accuracy": (correct * mask).sum() / count, "count": mask.sum()}


def lm_loss(logits, batch):
    import jax.numpy as jnp

    from jaxnn.train import language_model_loss

    loss, metrics = language_model_loss(logits, batch)
    return loss, {**metrics, "count": jnp.asarray(batch["y"].shape[0], jnp.float32)}


def evaluate(eval_fn, state, batches, place) -> dict:
    """Metrics over all `batches`, each batch weighted by its count of real examples."""
    import jax

    totals, total_count = {}, 0.0
    for host in batches:
        m = jax.device_get(eval_fn(state, place(host)))
        count = float(m.pop("count"))
        total_count += count
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + float(v) * count
    return {k: v / max(total_count, 1.0) for k, v in totals.items()}


def generate(predict, state, prompt: bytes, n: int, seq_len: int, *, seed: int = 0, temperature: float = 0.8) -> bytes:
    """Samples `n` bytes after `prompt` from a byte GPT, one compiled (1, seq_len) forward pass per byte."""
    import jax

    rng = np.random.default_rng(seed)
    context = list(prompt[-seq_len:])
    out = []
    for _ in range(n):
        window = np.zeros((1, seq_len), np.int32)
        window[0, :len(context)] = context
        logits = np.asarray(jax.device_get(predict(state.params, state.model_state, window)))[0, len(context) - 1]
        logits = logits.astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        token = int(rng.choice(len(p), p=p / p.sum()))
        out.append(token)
        context = (context + [token])[-seq_len:]
    return bytes(out)


def write_plots(metrics_path: pathlib.Path, out_dir: pathlib.Path) -> list[str]:
    """loss.png and accuracy.png (bits per byte for text) from the metrics JSON lines; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    series = {}
    for row in rows:  # a resumed run re-logs some steps: the later line wins
        for key, value in row.items():
            if key not in ("split", "step") and isinstance(value, (int, float)):
                series.setdefault((row["split"], key), {})[row["step"]] = value
    paths = []
    for name, key in (("loss", "loss"), ("accuracy", "accuracy"), ("accuracy", "bits_per_token")):
        curves = {split: sorted(series[(split, key)].items()) for split in ("train", "eval") if (split, key) in series}
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for split, points in curves.items():
            ax.plot(*zip(*points), marker="o" if split == "eval" else None, label=split)
        ax.set(xlabel="step", ylabel=key, title=f"{key} ({metrics_path.parent.name})")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(str(path))
    return paths


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Trains as `cfg` says and returns a summary dict (final eval metrics, throughput, input wait, paths)."""
    validate(cfg)
    check_run_dir(cfg)
    data = load_data(cfg)

    import jax
    from tqdm.auto import tqdm

    from jaxnn.checkpoint import Checkpointer, StopSignal
    from jaxnn.data import DevicePrefetch, PipelineConfig, TextCorpus, TrainBatches, eval_batches, host_iterator
    from jaxnn.data import iterator_state
    from jaxnn.models import get_model
    from jaxnn.parallel import batch_sharding, check_batch_divisible, make_mesh, process_slice, replicate, shard_batch
    from jaxnn.train import create_train_state, make_eval_step, make_optimizer, make_predict, make_train_step

    is_text = isinstance(data, TextCorpus)
    mcfg = model_config(cfg, data)
    model = get_model(cfg.model, mcfg)
    if cfg.devices > jax.local_device_count():
        raise ConfigError(f"--devices {cfg.devices}: only {jax.local_device_count()} {jax.default_backend()} "
                          "devices here")
    # Several processes (jax.distributed): one mesh over every device of every process; each process loads and
    # places only its own rows of each global batch, and only process 0 writes the run directory's files.
    multi_process = jax.process_count() > 1
    is_main = jax.process_index() == 0
    mesh = make_mesh() if multi_process else make_mesh(cfg.devices)
    check_batch_divisible(cfg.batch_size, mesh)
    if multi_process:
        from jax.experimental import multihost_utils

        # Every process has checked the run directory before any of them writes to it.
        multihost_utils.sync_global_devices("jaxnn run dir checked")
    pcfg = PipelineConfig(batch_size=cfg.batch_size, seed=cfg.seed, crop_pad=cfg.crop_pad, flip=cfg.flip,
                          seq_len=cfg.seq_len, backend=cfg.backend, workers=cfg.workers)
    in_shape = (cfg.batch_size, cfg.seq_len) if is_text else (cfg.batch_size, *data.image_shape)
    tx = make_optimizer(cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay)
    state = create_train_state(model, tx, jax.random.key(cfg.seed), in_shape, cfg.precision)
    state = replicate(state, mesh)

    run_dir = pathlib.Path(cfg.run_dir)
    ckpt_dir = pathlib.Path(cfg.ckpt_dir) if cfg.ckpt_dir else run_dir / "ckpt"
    if cfg.overwrite and is_main:
        for path in (ckpt_dir, run_dir / "metrics.jsonl"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    run_config = json.loads(json.dumps({**cfg.trajectory(), "model_config": dataclasses.asdict(mcfg)}))
    ckpt = Checkpointer(ckpt_dir, keep=cfg.keep, save_every=cfg.ckpt_every, ignore=RUN_ONLY_FIELDS)
    start = 0
    if cfg.resume:
        restored = ckpt.restore(state, run_config)
        if restored is None:
            log.warning("--resume: no checkpoint in %s; starting from step 0", ckpt_dir)
        else:
            state, data_state, start = restored
            if data_state.get("next_step") != start:
                raise ConfigError(f"checkpoint {ckpt_dir / str(start)}: data iterator at "
                                  f"{data_state.get('next_step')} but train state at step {start}")
    source = TrainBatches(data, pcfg, start, cfg.steps)
    if start:
        from jaxnn.checkpoint import config_differences

        # Same config, different files (e.g. a data directory whose contents changed) would shift every batch.
        diffs = config_differences(data_state, iterator_state(start, source))
        if diffs:
            raise ConfigError(f"checkpoint {ckpt_dir / str(start)}: its data iterator does not fit this data "
                              f"({'; '.join(diffs)})")
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.trajectory(), indent=1, sort_keys=True))
    metrics_path = run_dir / "metrics.jsonl"

    loss_fn = lm_loss if is_text else masked_classification_loss
    train_step = make_train_step(model, loss_fn, tx, cfg.precision)
    eval_step = make_eval_step(model, loss_fn, cfg.precision)
    in_sharding = batch_sharding(mesh)
    if multi_process:
        rows = process_slice(cfg.batch_size, mesh)

        def place(host):
            return shard_batch(jax.tree.map(lambda x: x[rows], host), mesh)
    else:
        def place(host):
            return jax.device_put(host, in_sharding)
    eval_data = eval_batches(data, cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    batches = DevicePrefetch(host_iterator(source, pcfg), place=place, size=cfg.prefetch)
    eval_every = cfg.eval_every or max(cfg.steps // 5, 1)

    def log_row(row):
        if not is_main:
            return
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def run_eval(step):
        metrics = evaluate(eval_step, state, eval_data, place)
        log_row({"split": "eval", "step": step, **metrics})
        return metrics

    interval = {"loss": 0.0, "accuracy": 0.0, "bits_per_token": 0.0, "n": 0}
    pending = None  # the previous step's metrics, read only after the next step is dispatched
    t_start = t_interval = time.perf_counter()
    steps_done = wait_total = 0
    eval_metrics, stop_signal = {}, None
    bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, disable=not cfg.progress,
               desc=f"{cfg.model}/{source.data.name}")

    def absorb(metrics):
        m = jax.device_get(metrics)
        for k in ("loss", "accuracy", "bits_per_token"):
            if k in m:
                interval[k] += float(m[k])
        interval["n"] += 1
        return float(m["loss"])

    with StopSignal() as stop:
        step = start
        for step in range(start + 1, cfg.steps + 1):
            batch = next(batches)
            state, metrics = train_step(state, batch)
            if pending is not None:
                bar.set_postfix(loss=f"{absorb(pending):.4f}", refresh=False)
            pending = metrics
            bar.update(1)
            steps_done += 1
            if step % cfg.log_every == 0 or step == cfg.steps:
                absorb(pending)
                pending = None
                now = time.perf_counter()
                wait = batches.take_wait()
                wait_total += wait
                n, dt = interval.pop("n"), now - t_interval
                row = {"split": "train", "step": step, **{k: v / max(n, 1) for k, v in interval.items() if v},
                       "examples_per_s": n * cfg.batch_size / dt, "input_wait_s": wait,
                       "input_wait_frac": wait / dt, "time_s": now - t_start}
                log_row(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", ex_s=f"{row['examples_per_s']:.0f}",
                                wait=f"{100 * row['input_wait_frac']:.1f}%")
                interval = {"loss": 0.0, "accuracy": 0.0, "bits_per_token": 0.0, "n": 0}
                t_interval = time.perf_counter()
            if step % eval_every == 0 or step == cfg.steps:
                eval_metrics = run_eval(step)
            ckpt.save(step, state, data_state=iterator_state(step, source), config=run_config)
            if stop:
                stop_signal = stop.received
                break
        if pending is not None:
            absorb(pending)
        if not eval_metrics and stop_signal is None:  # e.g. resumed a run that had already finished
            eval_metrics = run_eval(step)
        ckpt.save(step, state, data_state=iterator_state(step, source), config=run_config, force=True)
        ckpt.close()
    bar.close()
    elapsed = time.perf_counter() - t_start
    wait_total += batches.take_wait()

    summary = {"model": cfg.model, "dataset": source.data.name, "step": step, "steps": cfg.steps,
               "resumed_from": start, "interrupted_by": stop_signal, "time_s": elapsed,
               "examples_per_s": steps_done * cfg.batch_size / elapsed if steps_done else 0.0,
               "input_wait_frac": wait_total / elapsed if elapsed else 0.0, "run_dir": str(run_dir),
               "param_digest": None, **{f"eval_{k}": v for k, v in eval_metrics.items()}}
    from jaxnn.checkpoint import state_digest

    summary["param_digest"] = state_digest(state.params)
    if is_text and cfg.sample_bytes and stop_signal is None:
        predict = make_predict(model, cfg.precision)
        prompt = b"def "
        summary["sample"] = (prompt + generate(predict, state, prompt, cfg.sample_bytes, cfg.seq_len,
                                               seed=cfg.seed)).decode("utf-8", "replace")
    if cfg.plots and is_main and metrics_path.exists():
        summary["plots"] = write_plots(metrics_path, run_dir)
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
