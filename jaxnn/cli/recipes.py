"""What `jaxnn train` runs: a `TrainConfig` -> data set, built-in model, loss and optimizer -> `jaxnn.fit`.

Everything here is the choice of ingredients; the training itself is `jaxnn.loop.fit`, the same loop users call
with their own models.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from jaxnn._src.storage import write_json_atomic
from jaxnn.cli.config import TrainConfig
from jaxnn.errors import ConfigError

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
    from jaxnn.data import DataError, TextCorpus, detect_format, load_dataset, tokenize_corpus
    from jaxnn.data.loaders import formats_in
    from jaxnn.data.records import is_record_source, load_text_records
    from jaxnn.interop.tokenizer import load_tokenizer

    name = resolve_dataset(cfg)
    # The format --dataset names must be there; another one beside it is fine, since --dataset chose.
    wanted = "cifar10" if name == "cifar10" else "mnist"
    if cfg.data_dir and name in ("mnist", "fashion_mnist", "cifar10") and wanted not in formats_in(cfg.data_dir):
        raise DataError(f"{cfg.data_dir}: holds {detect_format(cfg.data_dir)} files, not the {name} format")
    tokenizer = _checkpoint_tokenizer(cfg)
    if name == "text" and cfg.data_dir and is_record_source(cfg.data_dir):  # JSONL: text, pairs, conversations
        from jaxnn.interop.chat import ChatTemplate

        template = ChatTemplate.from_folder(None if tokenizer is None else tokenizer.parent, cfg.chat_template)
        return load_text_records(cfg.data_dir, None if tokenizer is None else load_tokenizer(tokenizer),
                                 chat_template=template)  # fmt: skip
    data = load_dataset(name, cfg.data_dir)
    if tokenizer is not None and isinstance(data, TextCorpus):
        log.info("train: text tokenised with %s", tokenizer)
        return tokenize_corpus(data, tokenizer)
    return data


def _checkpoint_tokenizer(cfg: TrainConfig) -> pathlib.Path | None:
    """The tokenizer.json of the transformers folder the run starts from: a checkpoint is fine-tuned on its own
    vocabulary, not on bytes. A folder without one is refused unless its vocabulary is bytes (256 ids)."""
    from jaxnn.interop.hf import is_hf_folder, read_hf_config
    from jaxnn.interop.tokenizer import TOKENIZER_FILE

    if cfg.init_from is None or not is_hf_folder(cfg.init_from):
        return None
    path = pathlib.Path(cfg.init_from) / TOKENIZER_FILE
    if path.is_file():
        return path
    vocab = read_hf_config(cfg.init_from).get("vocab_size")
    if vocab != 256:
        raise ConfigError(
            f"--init-from {cfg.init_from}: no {TOKENIZER_FILE}, and its {vocab}-token vocabulary cannot read text as "
            "bytes; save the tokenizer into the folder (transformers' AutoTokenizer.save_pretrained writes one)"
        )
    return None


def model_config(cfg: TrainConfig, data: ImageDataset | TextCorpus) -> Any:
    """The built-in model's config: its default (or small) one with `cfg.model_overrides` and the data's sizes."""
    from jaxnn.data import TextCorpus
    from jaxnn.models.factory import model_config as built_in_config

    overrides = dict(cfg.model_overrides)
    if cfg.model == "gpt":
        overrides.setdefault("seq_len", cfg.seq_len)
    elif not isinstance(data, TextCorpus):
        given = overrides.setdefault("num_classes", data.num_classes)
        if isinstance(given, int) and given < data.num_classes:  # the flag is the culprit, not the data's labels
            raise ConfigError(
                f"--model-config num_classes={given}: the data set {data.name} has {data.num_classes} classes; "
                f"drop it (the data's count is the default) or give at least {data.num_classes}"
            )
        if cfg.model == "vit":  # its position table is sized for one image size: the data's
            overrides.setdefault("image_size", data.image_shape[0])
    return built_in_config(cfg.model, overrides, size=cfg.size)


def train(
    cfg: TrainConfig,
    *,
    callbacks: Iterable[Callback] = (),
    print_summary: Callable[[str], Any] | None = None,
    optimizer: Any = None,
) -> dict:
    """Trains the built-in model `cfg` names through `jaxnn.fit`; returns the run's summary dict.

    `print_summary`, when given (e.g. `print`), receives the model's per-layer table before training; `optimizer`
    replaces the flags' (`jaxnn train --lr-find`'s sweep).
    """
    import jax

    from jaxnn.callbacks import LearningRateLogger
    from jaxnn.data import PipelineConfig, TextCorpus
    from jaxnn.data.pipeline import TrainBatches
    from jaxnn.layers import summary as model_summary
    from jaxnn.loop import FitInputs, FitInterrupted, run_fit
    from jaxnn.models import get_model
    from jaxnn.train import make_optimizer, make_schedule

    if cfg.objective is not None:
        return _train_preference(cfg, list(callbacks))
    data = load_data(cfg)
    is_text = isinstance(data, TextCorpus)
    tokenizer_folder = _tokenizer_folder(cfg) if is_text else None
    mcfg = model_config(cfg, data)
    if isinstance(data, TextCorpus) and data.vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"the data's {data.vocab_size} token ids do not fit the model's vocabulary of {mcfg.vocab_size}"
        )
    model = get_model(cfg.model, mcfg)
    run = cfg.fit.resolved(name=f"{cfg.model}/{data.name}")  # the FitConfig the flags made, handed on whole
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
    total = run.steps if run.epochs is None else run.epochs * TrainBatches(data, pipeline, 0, 1).steps_per_epoch
    schedule = make_schedule(cfg.lr, total_steps=total, warmup_steps=cfg.warmup, decay=cfg.schedule)
    tx = optimizer or make_optimizer(
        cfg.lr,
        total_steps=total,
        warmup_steps=cfg.warmup,
        weight_decay=cfg.weight_decay,
        decay=cfg.schedule,
        clip_norm=run.clip_norm,
    )
    example = (cfg.seq_len,) if isinstance(data, TextCorpus) else data.image_shape
    if print_summary is not None and jax.process_index() == 0:
        model_summary(model, (batch_size, *example), policy=run.precision, print_fn=print_summary)
    train_data, eval_data, packing = _packed(cfg, data) if cfg.pack else (data, data, [])
    inputs = FitInputs(
        loss=_loss(cfg, is_text),
        optimizer=tx,
        eval_data=eval_data,
        pipeline=pipeline,
        callbacks=[
            *([LearningRateLogger(schedule)] if optimizer is None else []),
            *_tokenizer_keeper(tokenizer_folder),
            *packing,
            *callbacks,
        ],
        config={**cfg.trajectory(), "model_config": dataclasses.asdict(mcfg), **_tokenizer_entry(tokenizer_folder)},
        mesh=cfg.mesh,
        sharding_rules=cfg.sharding_rules,
        augment=cfg.augment,
        # The cosine schedule decays to 0 at the last step, so the step count is part of what the run computes.
        schedule_decays=cfg.schedule == "cosine",
        **_starting_point(cfg, model, mcfg, example),
    )
    try:
        result = run_fit(model, train_data, run, inputs)
    except FitInterrupted as stopped:  # Ctrl-C: the checkpoint is written; `jaxnn train` exits 130 after the summary
        result = stopped.result
    summary = {"model": cfg.model, "dataset": data.name, **result.summary}
    finished_now = not (summary.get("interrupted_by") or summary.get("already_finished"))
    # A sample reads as text through the run's tokenizer, or as bytes for a byte-level vocabulary.
    byte_level = getattr(mcfg, "vocab_size", 0) == 256 and tokenizer_folder is None
    if is_text and cfg.sample_bytes and finished_now and (byte_level or tokenizer_folder is not None):
        summary["sample"] = _sample(model, result.state, cfg, tokenizer_folder, data)
        if jax.process_index() == 0 and run.run_dir:
            write_json_atomic(pathlib.Path(run.run_dir) / "summary.json", summary)
    return summary


def _train_preference(cfg: TrainConfig, callbacks: list[Callback]) -> dict:
    """`jaxnn train --objective`: gpt tuned on `{"prompt", "chosen", "rejected"}` records (jaxnn.data.preference),
    evaluated on their test split; returns the run's summary dict."""
    from jaxnn.data import DataError
    from jaxnn.data.preference import load_preference_records
    from jaxnn.data.records import is_record_source
    from jaxnn.interop.chat import ChatTemplate
    from jaxnn.interop.tokenizer import load_tokenizer
    from jaxnn.loop import FitInputs, FitInterrupted, preference_start, run_fit
    from jaxnn.models import get_model
    from jaxnn.models.factory import model_config as built_in_config
    from jaxnn.train import make_optimizer

    if not (cfg.data_dir and is_record_source(cfg.data_dir)):
        raise DataError(f'--objective {cfg.objective}: --data must be .jsonl {{"prompt", "chosen", "rejected"}} '
                        f"records (a file or a folder of them), got {cfg.data_dir}")  # fmt: skip
    tokenizer = _checkpoint_tokenizer(cfg)
    folder = None if tokenizer is None else tokenizer.parent
    template = ChatTemplate.from_folder(folder, cfg.chat_template)
    train, test = load_preference_records(cfg.data_dir, None if tokenizer is None else load_tokenizer(tokenizer),
                                          window=cfg.seq_len, chat_template=template)  # fmt: skip
    mcfg = built_in_config(cfg.model, {"seq_len": cfg.seq_len, **dict(cfg.model_overrides)}, size=cfg.size)
    if int(train["x"].max()) >= mcfg.vocab_size:
        raise ConfigError(
            f"the data's token ids reach {int(train['x'].max())}, past the vocabulary of {mcfg.vocab_size}"
        )
    run = cfg.fit.resolved(name=f"gpt/{pathlib.Path(cfg.data_dir).stem}")
    per_epoch = max(1, len(train["x"]) // int(run.batch_size or 1))
    total = run.steps if run.epochs is None else run.epochs * per_epoch
    tx = make_optimizer(cfg.lr, total_steps=total, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay,
                        decay=cfg.schedule)  # fmt: skip
    model = get_model(cfg.model, mcfg)
    inputs = FitInputs(
        optimizer=tx, eval_data=test, callbacks=[*_tokenizer_keeper(folder), *callbacks],
        config={**cfg.trajectory(), "model_config": dataclasses.asdict(mcfg), **_tokenizer_entry(folder)},
        mesh=cfg.mesh, sharding_rules=cfg.sharding_rules, schedule_decays=cfg.schedule == "cosine",
        **_starting_point(cfg, model, mcfg, (cfg.seq_len,)),  # with the LoRA settings (--adapters' own, if given)
    )  # fmt: skip
    model, inputs = preference_start(model, train, str(cfg.objective), cfg.beta, 0.5, inputs)
    try:
        result = run_fit(model, train, run, inputs)
    except FitInterrupted as stopped:
        result = stopped.result
    return {"model": cfg.model, "dataset": pathlib.Path(cfg.data_dir).stem, **result.summary}


def _packed(cfg: TrainConfig, data: Any) -> tuple[dict, dict, list[Callback]]:
    """The records packed into windows (train, test) and a callback that reports the packing efficiency: in the
    log at the start, and in summary.json."""
    from jaxnn.callbacks import Callback
    from jaxnn.data.packing import pack_corpus, padding_efficiency

    train, test = pack_corpus(data, cfg.seq_len)
    unpacked = padding_efficiency(_train_documents(data), cfg.seq_len)
    log.info("train: %d records packed into %d windows of %d: %.1f%% real tokens (one record per window: %.1f%%)",
             train.documents, len(train.arrays["x"]), cfg.seq_len, 100 * train.efficiency, 100 * unpacked)  # fmt: skip

    class ReportPacking(Callback):
        def on_end(self, run: Any, summary: dict) -> None:
            summary["packing_efficiency"] = train.efficiency
            summary["unpacked_efficiency"] = unpacked

    return train.arrays, test.arrays, [ReportPacking()]


def _train_documents(data: Any) -> list:
    from jaxnn.data.packing import documents_of

    return documents_of(data.train, data.train_starts, data.train_targets)[0]


def _tokenizer_folder(cfg: TrainConfig) -> pathlib.Path | None:
    path = _checkpoint_tokenizer(cfg)
    return None if path is None else path.parent


def _tokenizer_entry(folder: pathlib.Path | None) -> dict[str, Any]:
    """The run record's "tokenizer": the digest `jaxnn generate` and `export` check their copy against."""
    from jaxnn.interop.tokenizer import tokenizer_record

    return {} if folder is None else {"tokenizer": tokenizer_record(folder)}


def _tokenizer_keeper(folder: pathlib.Path | None) -> list[Callback]:
    """A callback that copies the tokenizer files into the run directory once it is opened (process 0), so the
    run decodes its text wherever it is moved."""
    if folder is None:
        return []
    from jaxnn.callbacks import Callback
    from jaxnn.interop.tokenizer import copy_tokenizer

    source: pathlib.Path = folder

    class KeepTokenizer(Callback):
        def on_start(self, run: Any) -> None:
            if run.is_main and run.run_dir:
                copy_tokenizer(source, run.run_dir)

    return [KeepTokenizer()]


def _starting_point(cfg: TrainConfig, model: Any, mcfg: Any, example_shape: tuple[int, ...]) -> dict[str, Any]:
    """fit's keywords for where training starts: another jaxnn run's state (`init_from`), the parameters of a
    transformers folder (with `--adapters`' LoRA adapters beside them) or a torchvision ResNet (fine-tuning an
    imported checkpoint), or nothing (a fresh initialisation); and the LoRA settings to train with."""
    from jaxnn.interop.hf import is_hf_folder, load_hf
    from jaxnn.interop.tensors import is_tensor_file

    if cfg.adapters is not None and (cfg.init_from is None or not is_hf_folder(cfg.init_from)):
        raise ConfigError(f"--adapters {cfg.adapters} needs --init-from a transformers folder: the base they adapt")
    if cfg.init_from is not None and is_tensor_file(cfg.init_from):
        return {**_torchvision_start(cfg.init_from, model, mcfg, example_shape, cfg.fit.seed), "lora": cfg.lora}
    if cfg.init_from is None or not is_hf_folder(cfg.init_from):
        return {"init_from": cfg.init_from, "lora": cfg.lora}
    hf_cfg, params = load_hf(cfg.init_from)
    if cfg.adapters is None:
        return {"params": params, "lora": cfg.lora}
    params, settings = _given_adapters(cfg.adapters, hf_cfg, params)
    if cfg.lora is not None and (cfg.lora.rank, cfg.lora.alpha) != (settings.rank, settings.alpha):
        raise ConfigError(
            f"--lora r={cfg.lora.rank},alpha={cfg.lora.alpha:g} differs from the settings of --adapters "
            f"{cfg.adapters} (r={settings.rank},alpha={settings.alpha:g}); leave --lora out to train them as they are"
        )
    return {"params": params, "lora": settings}


def _given_adapters(path: str, hf_cfg: Any, params: Any) -> tuple[Any, Any]:
    """`params` with the adapters of a PEFT folder or a jaxnn adapter file, and their settings."""
    from jaxnn.interop.peft import load_peft
    from jaxnn.lora import load_adapters

    try:
        if pathlib.Path(path).is_dir():
            return load_peft(path, hf_cfg, params)
        return load_adapters(path, params)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--adapters {path}: {err}") from None


def _torchvision_start(path: str, model: Any, mcfg: Any, example_shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """A torchvision ResNet's params and BatchNorm statistics as the start of a transfer-learning run: a head for
    another number of classes than the data's starts afresh, and an RGB stem reads grayscale images as the gray
    value in all three channels (its kernels summed over the colours)."""
    import jax

    from jaxnn.finetune import load_into
    from jaxnn.interop.tensors import read_tensors
    from jaxnn.interop.torchvision import load_torchvision_resnet, resnet_config_from_state_dict
    from jaxnn.layers import init_model

    tensors = read_tensors(path)
    saved = resnet_config_from_state_dict(tensors)
    params, state = load_torchvision_resnet(tensors, saved)
    _, fresh, _ = init_model(model, jax.random.key(seed), (1, *example_shape))
    stem = params["0_conv1"]["w"]
    if example_shape[-1] == 1 and stem.shape[2] == 3:
        params = {**params, "0_conv1": {**params["0_conv1"], "w": stem.sum(axis=2, keepdims=True)}}
        log.warning("train: %s has an RGB stem; the grayscale images enter it in all three channels", path)
    if saved.num_classes != mcfg.num_classes:
        params, _ = load_into(fresh, params, exclude=("*_fc.*",))
        log.warning("train: %s has a %d-class head, the data %d classes: it starts afresh", path, saved.num_classes,
                    mcfg.num_classes)  # fmt: skip
    return {"params": params, "model_state": state}


def _loss(cfg: TrainConfig, is_text: bool) -> Any:
    from jaxnn.train import lm_loss, masked_classification_loss

    if is_text:
        return lm_loss
    if cfg.label_smoothing:
        return functools.partial(masked_classification_loss, label_smoothing=cfg.label_smoothing)
    return masked_classification_loss


SAMPLE_PROMPT_TOKENS = 16  # the end-of-run sample continues this much of the training text


def _sample(model, state, cfg: TrainConfig, tokenizer_folder: pathlib.Path | None, data: Any) -> str:
    """A continuation of the data's own first words, with every character a terminal prints as text (control
    characters a barely trained model emits are shown escaped, never sent to the terminal as they are)."""
    from jaxnn.generate import generate_text
    from jaxnn.interop.tokenizer import TOKENIZER_FILE, load_tokenizer

    tokenizer = None if tokenizer_folder is None else load_tokenizer(tokenizer_folder / TOKENIZER_FILE)
    first = [int(t) for t in data.train[: min(SAMPLE_PROMPT_TOKENS, cfg.seq_len // 2)]]
    prompt = bytes(first).decode("utf-8", "ignore") if tokenizer is None else tokenizer.decode(first)
    text = generate_text(
        model,
        state.params,
        prompt.split("\n", 1)[0] or prompt,  # its first line: a prompt, not a page
        cfg.sample_bytes,
        tokenizer=tokenizer,
        context_len=cfg.seq_len,
        key=cfg.fit.seed,
        model_state=state.model_state,
        policy=cfg.fit.precision,
    )
    return printable(text)


def printable(text: str) -> str:
    """`text` with each character that is not printable (but a newline or a tab) written as its escape."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)
