"""`jaxnn train ...`: typed flags (`jaxnn.cli.train_flags`) -> a frozen `TrainConfig` (holding the `FitConfig`) ->
`jaxnn.cli.recipes`.

The config is built and validated before jax starts; the process's devices are then set up (simulated CPU devices
for `--devices`/`--mesh`, or joining a multi-process run), and only then is jax's work begun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import pathlib
from typing import TYPE_CHECKING, Any

from jaxnn.cli.config import TrainConfig, parse_model_config
from jaxnn.cli.replay import replayed
from jaxnn.config import FitConfig
from jaxnn.errors import ConfigError

if TYPE_CHECKING:
    from jaxnn.callbacks import Callback


def set_cpu_devices(n: int) -> None:
    """Asks for `n` CPU devices before jax initialises; later (e.g. in tests) whatever count exists is kept and
    the run checks that it has at least `n`."""
    from jaxnn.parallel.mesh import configure_cpu_devices

    with contextlib.suppress(RuntimeError):
        configure_cpu_devices(n)


def default_run_dir(model: str, data: str | None, resume: bool) -> str:
    base = pathlib.Path("runs") / f"{model}-{pathlib.Path(data).name if data else 'default'}"
    if resume:
        previous = sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []
        if previous:
            return str(previous[-1])
    return str(base / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def model_and_base_fields(name: str | None, init_from: str | None) -> tuple[str, dict[str, Any] | None]:
    """The model family `jaxnn train` builds, and the config fields it starts from: those of the checkpoint
    `init_from` names (a transformers folder, a torchvision ResNet file), or a preset's, or None (the family's
    `jaxnn train` defaults). A preset `name` that disagrees with the checkpoint's architecture is refused, naming
    both. jax is imported, not started: the device count is set after this."""
    from jaxnn.interop.hf import is_hf_folder
    from jaxnn.interop.tensors import is_tensor_file
    from jaxnn.models.presets import PRESETS

    family = PRESETS[name].family if name in PRESETS else name
    if init_from is not None and (is_hf_folder(init_from) or is_tensor_file(init_from)):
        kind, wanted = (
            ("a transformers decoder", "gpt")
            if is_hf_folder(init_from)
            else ("a torchvision ResNet", "imagenet_resnet")
        )
        if family is not None and family != wanted:
            raise ConfigError(f"--init-from {init_from} is {kind}: it trains as {wanted}, not {name!r}")
        saved = _checkpoint_config(init_from, wanted)
        if name in PRESETS:
            _refuse_other_architecture(name, PRESETS[name].config, init_from, saved)
        family, fields = wanted, dataclasses.asdict(saved)
    elif name in PRESETS:
        fields = dataclasses.asdict(PRESETS[name].config)
    else:
        return name or "cnn", None
    # What the data decide (recipes.model_config sets them): an ImageNet head and image size are not the bundled
    # digits'; recipes replaces a checkpoint's head when the counts differ. A --model-config still sets them.
    for data_field in _DATA_FIELDS:
        fields.pop(data_field, None)
    return str(family), fields


# Config fields that follow the data (or that change how a model computes, not what it is).
_DATA_FIELDS = ("num_classes", "image_size")
_NOT_ARCHITECTURE = (*_DATA_FIELDS, "attention_implementation", "drop_prob", "scan_layers", "remat")


def _checkpoint_config(path: str, family: str) -> Any:
    """The config of the model a transformers folder or a torchvision file holds (headers only for the latter)."""
    from jaxnn.interop.hf import config_from_hf, read_hf_config
    from jaxnn.interop.tensors import read_tensor_shapes
    from jaxnn.interop.torchvision import resnet_config_from_state_dict

    if family == "gpt":
        return config_from_hf(read_hf_config(path))
    return resnet_config_from_state_dict(read_tensor_shapes(path))


def _refuse_other_architecture(name: str, preset: Any, path: str, saved: Any) -> None:
    """`--model PRESET --init-from CHECKPOINT` must name the checkpoint's own architecture: training silently
    on the checkpoint's would make a model of another size than the one asked for."""
    fields = [f.name for f in dataclasses.fields(preset) if f.name not in _NOT_ARCHITECTURE]
    differ = [f"{f} {getattr(preset, f)!r} against {getattr(saved, f)!r}" for f in fields
              if getattr(preset, f) != getattr(saved, f)]  # fmt: skip
    if differ:
        raise ConfigError(
            f"--model {name} and --init-from {path} are different architectures ({', '.join(differ[:3])}"
            f"{', ...' if len(differ) > 3 else ''}); drop --model to train the checkpoint's own, or name its preset"
        )


def _window(args: argparse.Namespace, fields: dict[str, Any], defaults: dict[str, Any]) -> int:
    """The text window: --seq-len, else a checkpoint's own context length, else the model's default. A window
    longer than a checkpoint's learned position table is refused (it has no rows for those positions)."""
    from jaxnn.interop.hf import is_hf_folder

    from_checkpoint = args.init_from is not None and "seq_len" in fields and is_hf_folder(args.init_from)
    if not from_checkpoint:
        return args.seq_len if args.seq_len is not None else defaults.get("seq_len", 128)
    table = int(fields["seq_len"])
    if args.seq_len is None:
        return table
    if args.seq_len > table and fields.get("position", "learned") == "learned":
        raise ConfigError(
            f"--seq-len {args.seq_len} is longer than {args.init_from}'s {table} learned positions; use at most {table}"
        )
    return args.seq_len


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run the flags ask for; each value is checked by the config that holds it (a ConfigError names it)."""
    from jaxnn.models.factory import MODEL_DEFAULTS, default_model_overrides

    model, base = model_and_base_fields(args.model, args.init_from)
    defaults = MODEL_DEFAULTS.get(model, {})
    overrides = default_model_overrides(model, args.size) if base is None else base
    for flag, field in (("d_model", "d_model"), ("layers", "num_layers")):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    overrides.update(parse_model_config(args.model_config))
    if args.remat is not None:
        if model != "gpt":
            raise ConfigError(f"--remat {args.remat}: rematerialisation is offered for --model gpt, not {model!r}")
        overrides["remat"] = args.remat

    def pick(name: str, fallback: Any) -> Any:
        return getattr(args, name) if getattr(args, name) is not None else defaults.get(name, fallback)

    if args.epochs is not None and args.steps is not None:
        raise ConfigError(f"--steps {args.steps} and --epochs {args.epochs} exclude each other; give one")

    fit = FitConfig(
        steps=pick("steps", 600),
        epochs=args.epochs,
        accumulate=args.accumulate,
        batch_size=pick("batch_size", 64),
        precision=args.precision,
        clip_norm=args.clip_norm,
        seed=args.seed,
        eval_every=args.eval_every,
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
        keep=args.keep,
        keep_best=args.keep_best,
        keep_best_mode=args.keep_best_mode,
        check_data=args.check_data,
        run_dir=args.run_dir or default_run_dir(args.model or model, args.data, args.resume),
        ckpt_dir=args.ckpt_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        metrics=tuple(args.metrics),
        progress=not args.no_progress,
        plots=not args.no_plots,
        devices=args.devices,
        prefetch=args.prefetch,
        profile_dir=args.profile_dir,
        compile_cache="off" if args.no_compile_cache else args.compile_cache,
    )
    return TrainConfig(
        model=model,
        dataset=args.dataset,
        data_dir=args.data,
        size=args.size,
        model_overrides=tuple(sorted(overrides.items())),
        lr=pick("lr", 3e-3),
        warmup=pick("warmup", 0),
        weight_decay=args.weight_decay,
        crop_pad=args.crop_pad,
        flip=args.flip,
        seq_len=_window(args, overrides if base is not None else {}, defaults),
        mesh=args.mesh,
        sharding_rules=args.sharding_rules,
        backend=args.backend,
        workers=args.workers,
        schedule=args.schedule,
        label_smoothing=args.label_smoothing,
        init_from=args.init_from,
        adapters=args.adapters,
        augment=args.augment,
        lora=args.lora,
        pack=args.pack,
        chat_template=args.chat_template,
        objective=args.objective,
        beta=args.beta,
        fit=fit,
    )


def format_summary(s: dict) -> str:
    if s.get("already_finished"):
        return f"the run in {s['run_dir']} already finished at step {s['step']}; nothing to do"
    if "eval_accuracy" in s:
        quality = f"test accuracy {100 * s['eval_accuracy']:.2f}% (loss {s['eval_loss']:.4f})"
    elif "eval_bits_per_token" in s:
        unit = "token" if str(s.get("dataset", "")).endswith("-tokens") else "byte"  # tokenize_corpus names it
        quality = f"test {s['eval_bits_per_token']:.3f} bits/{unit} (loss {s['eval_loss']:.4f})"
    elif "eval_preference_accuracy" in s:
        quality = (
            f"test preference accuracy {100 * s['eval_preference_accuracy']:.1f}% "
            f"(reward margin {s['eval_reward_margin']:.3f}, loss {s['eval_loss']:.4f})"
        )
    else:
        quality = "no evaluation"
    stopped = f", stopped by signal {s['interrupted_by']}" if s.get("interrupted_by") else ""
    stopped += f", {s['stopped_by']}" if s.get("stopped_by") else ""
    skipped = f", {s['skipped_steps']} steps skipped (overflow)" if s.get("skipped_steps") else ""
    return (
        f"{s['model']} on {s['dataset']}: step {s['step']}/{s['steps']}, {quality}, "
        f"{s['examples_per_s']:.0f} examples/s, input wait {100 * s['input_wait_frac']:.1f}%{skipped}, "
        f"{s['time_s']:.1f} s{stopped} -> {s['run_dir']}"
    )


def multi_process_asked(args: argparse.Namespace) -> bool:
    """Whether flags, JAXNN_* variables or --cluster ask for a multi-process run."""
    from jaxnn.parallel import mesh

    return bool(
        args.cluster
        or any(v is not None for v in (args.coordinator, args.num_processes, args.process_id))
        or any(os.environ.get(v) for v in (mesh.ENV_COORDINATOR, mesh.ENV_NUM_PROCESSES))
    )


def start_processes(args: argparse.Namespace) -> bool:
    """Joins a multi-process run when one is asked for (`multi_process_asked`; before any jax work)."""
    from jaxnn.parallel import mesh

    if not multi_process_asked(args):
        return False
    if args.run_dir is None:
        raise ValueError("a multi-process run needs --run-dir (every process must write the same run)")
    return mesh.initialize_distributed(
        args.coordinator, args.num_processes, args.process_id, heartbeat_timeout_s=args.heartbeat_timeout
    )


def callbacks_from_args(args: argparse.Namespace, multi_process: bool) -> list[Callback]:
    from jaxnn.callbacks import ExitAt, StepWatchdog

    callbacks: list[Callback] = [StepWatchdog(args.step_timeout)] if multi_process else []
    if args.fail_at:
        callbacks.append(ExitAt(args.fail_at[1], process_index=args.fail_at[0]))
    return callbacks


def train_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn train`; errors go to `jaxnn.cli.main`'s exit-status table."""
    args = replayed(args) if args.config else args  # --config FILE: a run's config.json as the flags' values
    cfg = config_from_args(args)  # validated here, before jax starts
    # One process simulates the whole mesh; in a multi-process run each has --devices and the mesh spans all.
    one_process = not multi_process_asked(args)
    set_cpu_devices(cfg.mesh.devices if cfg.mesh and one_process else args.devices)
    if cfg.mesh:  # the layout report (what each mesh axis splits) is printed before training, not only logged
        logging.getLogger("jaxnn.parallel.report").setLevel(logging.INFO)
    logging.getLogger("jaxnn.levers").setLevel(logging.INFO)  # the run's start-of-run block (jaxnn.loop._levers)
    multi_process = start_processes(args)
    from jaxnn._src import compile_cache

    compile_cache.enable(cfg.fit.compile_cache)  # before the model summary and data set-up compile anything
    from jaxnn.cli.recipes import train

    if args.lr_find:  # the range test instead of the run (jaxnn.cli.lr_find)
        from jaxnn.cli.lr_find import lr_find_main

        return lr_find_main(cfg, callbacks_from_args(args, multi_process))
    summary = train(
        cfg, callbacks=callbacks_from_args(args, multi_process), print_summary=None if args.no_summary else print
    )
    if "sample" in summary:
        print("--- sample ---")
        print(summary["sample"])
        print("--------------")
    print(format_summary(summary))
    if multi_process:
        import jax

        print(
            f"jaxnn: process {jax.process_index()} of {jax.process_count()} ({jax.device_count()} devices): "
            f"step {summary['step']}, params {summary['param_digest'][:16]}"
        )
    return 128 + summary["interrupted_by"] if summary.get("interrupted_by") else 0
