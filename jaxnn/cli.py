"""`jaxnn train ...` (also `python -m jaxnn.cli train ...`): typed flags -> a frozen TrainConfig -> jaxnn.recipes.

jax is imported only after the flags are parsed and the config is built, because `--devices N` on a CPU-only
machine must set the number of simulated CPU devices before jax initialises its backends. Exit status: 0 done
(also when a resumed run had already finished), 2 bad input (one line, nothing written), 1 a failure while
training (one line: a non-finite loss, a full disk), 128+N stopped by signal N after a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from jaxnn.config import MODEL_DEFAULTS, ConfigError, TrainConfig

if TYPE_CHECKING:
    from jaxnn.callbacks import Callback

EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxnn", description="jaxnn: train models with JAX on the host at hand.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    from jaxnn.profile_cli import add_profile_parser

    add_profile_parser(sub)
    return parser


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a model; checkpoints, metrics.jsonl and plots go to the run directory.",
    )
    a = p.add_argument
    a("--model", default="cnn", help="model: mlp, cnn, resnet or gpt")
    a(
        "--data",
        default=None,
        metavar="DIR",
        help="directory of MNIST/Fashion-MNIST IDX, CIFAR-10 binary or text "
        "files (default: the bundled digits, or the Python stdlib source for gpt)",
    )
    a("--dataset", default="auto", help="data format: auto, digits, mnist, fashion_mnist, cifar10, text, synthetic")
    a("--size", default="base", help="model size: base (the model's default config) or small (for quick runs)")
    a("--steps", type=int, default=None, help="training steps (default per model)")
    a("--batch-size", type=int, default=None, help="global batch size, split over --devices (default per model)")
    a("--precision", default="fp32", help="precision policy: fp32, tf32, bf16 or fp16")
    a("--lr", type=float, default=None, help="peak learning rate of AdamW (default per model)")
    a("--warmup", type=int, default=None, help="linear warm-up steps before the cosine decay")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay on kernels")
    a("--seed", type=int, default=0, help="seed for initialisation, shuffling and augmentation")
    a("--seq-len", type=int, default=None, help="gpt: context length in bytes")
    a("--d-model", type=int, default=None, help="gpt: model width (default 128)")
    a("--layers", type=int, default=None, help="gpt: number of transformer blocks")
    a(
        "--model-config",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="set fields of the model's config (values as JSON, else text), e.g. gpt's "
        "position=rope norm=rms num_kv_heads=2 scan_layers=true",
    )
    a("--crop-pad", type=int, default=0, help="images: random crop after zero-padding by this many pixels")
    a("--flip", action="store_true", help="images: random horizontal flips")
    a(
        "--run-dir",
        default=None,
        help="run directory (default runs/<model>-<data>/<time>; with --resume, the newest of those)",
    )
    a("--ckpt-dir", default=None, help="checkpoint directory (default <run-dir>/ckpt)")
    a("--resume", action="store_true", help="continue from the newest good checkpoint in the run directory")
    a("--overwrite", action="store_true", help="replace the run in --run-dir instead of refusing")
    a("--eval-every", type=int, default=0, help="evaluate every N steps (0: five times per run)")
    a("--log-every", type=int, default=50, help="log metrics and input wait every N steps")
    a("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end and on a signal)")
    a("--keep", type=int, default=3, help="checkpoints to keep")
    a(
        "--devices",
        type=int,
        default=1,
        help="data-parallel devices of this process (on a CPU, that many simulated devices)",
    )
    a(
        "--mesh",
        default=None,
        metavar="AXIS=SIZE,...",
        help="shard over a device mesh: data (batch), fsdp (batch and every large parameter and optimizer moment), "
        "tensor (attention heads and MLP width), e.g. data=2,fsdp=4; on a CPU, that many simulated devices",
    )
    add_multiprocess_flags(p)
    add_pipeline_and_output_flags(p)


def add_pipeline_and_output_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for the host pipeline, what the run writes and prints, and its compilation cache."""
    a = p.add_argument
    a("--prefetch", type=int, default=2, help="batches put on the device ahead of the step (0: none)")
    a("--backend", default="grain", choices=("grain", "inline"), help="host pipeline: Grain workers or inline")
    a("--workers", type=int, default=0, help="Grain worker processes (0: reader threads in this process)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--no-plots", action="store_true", help="no PNG plots at the end")
    a(
        "--metrics",
        nargs="+",
        default=[],
        choices=("csv", "tensorboard"),
        help="metric writers besides metrics.jsonl: CSV files, TensorBoard event files (<run-dir>/tensorboard)",
    )
    a("--no-summary", action="store_true", help="do not print the model's per-layer table at the start")
    a("--profile-dir", default=None, metavar="DIR", help="write a jax.profiler trace of a few steps after warm-up")
    a(
        "--compile-cache",
        default="auto",
        metavar="DIR",
        help="directory of JAX's persistent compilation cache; auto: $JAXNN_COMPILE_CACHE, else ~/.cache/jaxnn/xla",
    )
    a("--no-compile-cache", action="store_true", help="compile every program afresh (no persistent cache)")


def add_multiprocess_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for runs of several processes (one per host, or local ones on 127.0.0.1)."""
    a = p.add_argument
    a(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-process run: address of process 0's coordination service (or JAXNN_COORDINATOR)",
    )
    a("--num-processes", type=int, default=None, help="multi-process run: number of processes (or JAXNN_NUM_PROCESSES)")
    a("--process-id", type=int, default=None, help="multi-process run: this process's index (or JAXNN_PROCESS_ID)")
    a("--cluster", action="store_true", help="multi-process run: let jax detect the processes (SLURM, Open MPI)")
    a(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="multi-process run: seconds after which a silent process counts as dead and the others stop",
    )
    a(
        "--step-timeout",
        type=float,
        default=300,
        help="multi-process run: stop if no step finishes in this many seconds (a peer died)",
    )
    a("--fail-at", type=int, nargs=2, metavar=("PROCESS", "STEP"), default=None, help=argparse.SUPPRESS)


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="export a trained model for inference without jaxnn",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a run's checkpoint as model.jaxexport (a serialized jax.export program with a symbolic "
        "batch size), weights.safetensors and export.json (shapes, dtypes, how to call it).",
    )
    p.add_argument("--run-dir", required=True, help="run directory of `jaxnn train` (or its ckpt/ or a step folder)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (files in it are replaced)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest readable one)")
    p.add_argument(
        "--platforms", nargs="+", default=["cpu"], choices=("cpu", "cuda", "rocm", "tpu"), help="platforms to lower for"
    )
    p.add_argument("--safetensors-only", action="store_true", help="write only weights.safetensors")


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="print text sampled from a trained GPT run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Continue a prompt with the newest (or --step's) checkpoint of a `jaxnn train --model gpt` run, "
        "decoding with a KV cache.",
    )
    p.add_argument("--run-dir", required=True, help="run directory of `jaxnn train` (or its ckpt/ or a step folder)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--length", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely bytes of this total mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest readable one)")


def mesh_devices(mesh: str) -> int:
    """The number of devices a mesh spec ("data=2,fsdp=4") spans."""
    from jaxnn.sharding import parse_mesh

    return math.prod(parse_mesh(mesh).values())


def set_cpu_devices(n: int) -> None:
    """Asks for `n` CPU devices before jax initialises; later (e.g. in tests) whatever count exists is kept and
    the run checks that it has at least `n`."""
    from jaxnn.mesh import configure_cpu_devices

    with contextlib.suppress(RuntimeError):
        configure_cpu_devices(n)


def default_run_dir(model: str, data: str | None, resume: bool) -> str:
    base = pathlib.Path("runs") / f"{model}-{pathlib.Path(data).name if data else 'default'}"
    if resume:
        previous = sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []
        if previous:
            return str(previous[-1])
    return str(base / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def parse_model_config(items: list[str]) -> dict[str, Any]:
    """`["position=rope", "num_kv_heads=2"]` -> {"position": "rope", "num_kv_heads": 2}: JSON values, else text."""
    fields: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--model-config: expected FIELD=VALUE, got {item!r}")
        try:
            fields[name] = json.loads(text)
        except json.JSONDecodeError:
            fields[name] = text
    return fields


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    defaults = dict(MODEL_DEFAULTS.get(args.model, {}))
    overrides = dict(defaults.pop("model_overrides", ()))
    for flag, field in (("d_model", "d_model"), ("layers", "num_layers")):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.size == "small":  # the small config's own widths, unless asked otherwise
        flag_of: dict[str, str] = {"num_layers": "layers"}
        overrides = {k: v for k, v in overrides.items() if getattr(args, flag_of.get(k) or k, None)}
    overrides.update(parse_model_config(args.model_config))

    def pick(name: str, fallback: Any) -> Any:
        return getattr(args, name) if getattr(args, name) is not None else defaults.get(name, fallback)

    return TrainConfig(
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data,
        size=args.size,
        model_overrides=tuple(sorted(overrides.items())),
        steps=pick("steps", 600),
        batch_size=pick("batch_size", 64),
        precision=args.precision,
        lr=pick("lr", 3e-3),
        warmup=pick("warmup", 0),
        weight_decay=args.weight_decay,
        seed=args.seed,
        crop_pad=args.crop_pad,
        flip=args.flip,
        seq_len=pick("seq_len", 128),
        run_dir=args.run_dir or default_run_dir(args.model, args.data, args.resume),
        ckpt_dir=args.ckpt_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        devices=args.devices,
        mesh=args.mesh,
        eval_every=args.eval_every,
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
        keep=args.keep,
        prefetch=args.prefetch,
        backend=args.backend,
        workers=args.workers,
        progress=not args.no_progress,
        plots=not args.no_plots,
        metrics=tuple(args.metrics),
        profile_dir=args.profile_dir,
        compile_cache="off" if args.no_compile_cache else args.compile_cache,
    )


def format_summary(s: dict) -> str:
    if s.get("already_finished"):
        return f"the run in {s['run_dir']} already finished at step {s['step']}; nothing to do"
    if "eval_accuracy" in s:
        quality = f"test accuracy {100 * s['eval_accuracy']:.2f}% (loss {s['eval_loss']:.4f})"
    elif "eval_bits_per_token" in s:
        quality = f"test {s['eval_bits_per_token']:.3f} bits/byte (loss {s['eval_loss']:.4f})"
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
    import os

    from jaxnn import mesh

    return bool(
        args.cluster
        or any(v is not None for v in (args.coordinator, args.num_processes, args.process_id))
        or any(os.environ.get(v) for v in (mesh.ENV_COORDINATOR, mesh.ENV_NUM_PROCESSES))
    )


def start_processes(args: argparse.Namespace) -> bool:
    """Joins a multi-process run when one is asked for (`multi_process_asked`; before any jax work)."""
    from jaxnn import mesh

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
    from jaxnn.callbacks import NonFiniteError
    from jaxnn.rundir import StorageError

    try:
        cfg = config_from_args(args)  # validated here, before jax starts
        # One process simulates the whole mesh; in a multi-process run each has --devices and the mesh spans all.
        one_process = not multi_process_asked(args)
        set_cpu_devices(mesh_devices(cfg.mesh) if cfg.mesh and one_process else args.devices)
        multi_process = start_processes(args)
        from jaxnn import compile_cache

        compile_cache.enable(cfg.compile_cache)  # before the model summary and data set-up compile anything
        from jaxnn.recipes import train

        summary = train(
            cfg, callbacks=callbacks_from_args(args, multi_process), print_summary=None if args.no_summary else print
        )
    except (NonFiniteError, StorageError) as err:
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:  # ConfigError, DataError, RunDirError, CheckpointError: refused before any write
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_USAGE
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


def export_main(args: argparse.Namespace) -> int:
    from jaxnn.export import export_run
    from jaxnn.rundir import StorageError

    try:
        out = export_run(
            args.run_dir, args.out, platforms=args.platforms, step=args.step, safetensors_only=args.safetensors_only
        )
    except StorageError as err:
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:  # CheckpointError, ConfigError, DataError: no run, or not one of a built-in model
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    what = "weights" if args.safetensors_only else f"model for {', '.join(args.platforms)}"
    print(f"jaxnn: exported the {what} of {args.run_dir} -> {out}")
    return 0


def generate_main(args: argparse.Namespace) -> int:
    import jax

    from jaxnn.checkpoint import load_params
    from jaxnn.generate import generate_bytes
    from jaxnn.recipes import model_from_config
    from jaxnn.rundir import StorageError

    try:
        if args.length < 1:
            raise ValueError(f"--length must be positive, got {args.length}")
        loaded = load_params(args.run_dir, step=args.step)
        model, mcfg = model_from_config(loaded.config)
        if loaded.config.get("model") != "gpt":
            raise ValueError(f"{args.run_dir}: a {loaded.config.get('model')!r} run; generate needs a GPT run")
        text = generate_bytes(
            model,
            loaded.params,
            args.prompt.encode(),
            args.length,
            context_len=mcfg.seq_len if mcfg.position == "learned" else None,
            key=jax.random.key(args.seed),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            model_state=loaded.model_state,
            policy=loaded.config.get("precision", "fp32"),
        )
    except StorageError as err:
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:  # CheckpointError, ConfigError, bad sampling options
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print((args.prompt.encode() + text).decode("utf-8", "replace"))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return train_main(args)
    if args.command == "export":
        return export_main(args)
    if args.command == "generate":
        return generate_main(args)
    if args.command == "profile":
        from jaxnn.profile_cli import profile_main

        return profile_main(args)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
