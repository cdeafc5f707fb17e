"""What `jaxnn train` runs: a `TrainConfig` -> data set, built-in model, loss and optimizer -> `jaxnn.fit`.

Everything here is the choice of ingredients; the training itself is `jaxnn.loop.fit`, the same loop users call
with their own models.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from jaxnn.config import ConfigError, TrainConfig
from jaxnn.storage import write_json_atomic

if TYPE_CHECKING:
    from jaxnn.callbacks import Callback
    from jaxnn.data import ImageDataset, TextCorpus

log = logging.getLogger(__name__)


def resolve_dataset(cfg: TrainConfig) -> str:
    """The data set name for `cfg` ("auto": text for gpt, the format found in `data_dir`, else digits)."""
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
        raise ConfigError(
            f"model {cfg.model!r} cannot train on data set {name!r}: "
            f"{'gpt needs text' if cfg.model == 'gpt' else 'text needs --model gpt'}"
        )
    if cfg.data_dir and name in ("digits", "synthetic"):
        raise ConfigError(f"data set {name!r} is built in; drop --data {cfg.data_dir}")
    return name


def load_data(cfg: TrainConfig) -> ImageDataset | TextCorpus:
    """The data set the config names, checked against the format (a DataError names the file otherwise)."""
    from jaxnn.data import DataError, detect_format, load_dataset

    name = resolve_dataset(cfg)
    if cfg.data_dir and name in ("mnist", "fashion_mnist", "cifar10"):
        found = detect_format(cfg.data_dir)
        if found != ("cifar10" if name == "cifar10" else "mnist"):
            raise DataError(f"{cfg.data_dir}: holds {found} files, not the {name} format")
    return load_dataset(name, cfg.data_dir)


def model_config(cfg: TrainConfig, data: ImageDataset | TextCorpus) -> Any:
    """The built-in model's config: its default (or small) one with `cfg.model_overrides` and the data's sizes."""
    from jaxnn.data import TextCorpus
    from jaxnn.models.factory import model_config as built_in_config

    overrides = dict(cfg.model_overrides)
    if cfg.model == "gpt":
        overrides.setdefault("seq_len", cfg.seq_len)
    elif not isinstance(data, TextCorpus):
        overrides.setdefault("num_classes", data.num_classes)
    return built_in_config(cfg.model, overrides, size=cfg.size)


def train(
    cfg: TrainConfig, *, callbacks: Iterable[Callback] = (), print_summary: Callable[[str], Any] | None = None
) -> dict:
    """Trains the built-in model `cfg` names through `jaxnn.fit`; returns the run's summary dict.

    `print_summary`, when given (e.g. `print`), receives the model's per-layer table before training.
    """
    import jax

    from jaxnn.callbacks import LearningRateLogger
    from jaxnn.data import PipelineConfig, TextCorpus
    from jaxnn.layers import summary as model_summary
    from jaxnn.loop import fit
    from jaxnn.models import get_model
    from jaxnn.train import lm_loss, make_optimizer, make_schedule, masked_classification_loss

    data = load_data(cfg)
    is_text = isinstance(data, TextCorpus)
    mcfg = model_config(cfg, data)
    model = get_model(cfg.model, mcfg)
    run = dataclasses.replace(cfg.fit, name=f"{cfg.model}/{data.name}")
    batch_size = int(run.batch_size or 0)  # TrainConfig refuses None
    pipeline = PipelineConfig(
        batch_size=batch_size,
        seed=run.seed,
        crop_pad=cfg.crop_pad,
        flip=cfg.flip,
        seq_len=cfg.seq_len,
        backend=cfg.backend,
        workers=cfg.workers,
    )
    schedule = make_schedule(cfg.lr, total_steps=run.steps, warmup_steps=cfg.warmup)
    tx = make_optimizer(cfg.lr, total_steps=run.steps, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay)
    if print_summary is not None and jax.process_index() == 0:
        example = (cfg.seq_len,) if isinstance(data, TextCorpus) else data.image_shape
        model_summary(model, (batch_size, *example), policy=run.precision, print_fn=print_summary)
    result = fit(
        model,
        data,
        loss=lm_loss if is_text else masked_classification_loss,
        optimizer=tx,
        eval_data=data,
        pipeline=pipeline,
        callbacks=[LearningRateLogger(schedule), *callbacks],
        config={**cfg.trajectory(), "model_config": dataclasses.asdict(mcfg)},
        mesh=cfg.mesh,
        **{f.name: getattr(run, f.name) for f in dataclasses.fields(run)},
    )
    summary = {"model": cfg.model, "dataset": data.name, **result.summary}
    finished_now = not (summary.get("interrupted_by") or summary.get("already_finished"))
    if is_text and cfg.sample_bytes and finished_now:
        summary["sample"] = _sample(model, result.state, cfg)
        if jax.process_index() == 0 and run.run_dir:
            write_json_atomic(pathlib.Path(run.run_dir) / "summary.json", summary)
    return summary


def _sample(model, state, cfg: TrainConfig) -> str:
    import jax

    from jaxnn.generate import generate_bytes

    prompt = b"def "
    text = generate_bytes(
        model,
        state.params,
        prompt,
        cfg.sample_bytes,
        context_len=cfg.seq_len,
        key=jax.random.key(cfg.fit.seed),
        model_state=state.model_state,
        policy=cfg.fit.precision,
    )
    return (prompt + text).decode("utf-8", "replace")
