"""`jaxnn export` and `jaxnn generate`: what a finished run is used for."""

from __future__ import annotations

import argparse
from typing import Any


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="export a trained model for inference without jaxnn",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a run's checkpoint as model.jaxexport (a serialized jax.export program with a symbolic "
        "batch size), weights.safetensors and export.json (shapes, dtypes, how to call it).",
    )
    p.add_argument("--run-dir", required=True, help="run directory of `jaxnn train` (or its ckpt/ or a step folder)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output directory: new, or holding this same export (another export or foreign files are refused)",
    )
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
        "decoding with a KV cache. Prompt and output lengths are rounded up to powers of two, so a new prompt length "
        "reuses a compiled program, which the persistent compile cache keeps for the next run.",
    )
    p.add_argument("--run-dir", required=True, help="run directory of `jaxnn train` (or its ckpt/ or a step folder)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--length", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely bytes of this total mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest readable one)")
    p.add_argument("--stop", default=None, metavar="CHAR", help="end after this one-byte character (e.g. a newline)")
    p.add_argument(
        "--compile-cache",
        default="auto",
        metavar="DIR",
        help="jax's persistent compilation cache: 'auto' ($JAXNN_COMPILE_CACHE, else ~/.cache/jaxnn/xla), 'off' or "
        "a directory",
    )


def export_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn export`; errors go to `jaxnn.cli.main`'s exit-status table."""
    from jaxnn.export import export_run

    out = export_run(
        args.run_dir, args.out, platforms=args.platforms, step=args.step, safetensors_only=args.safetensors_only
    )
    what = "weights" if args.safetensors_only else f"model for {', '.join(args.platforms)}"
    print(f"jaxnn: exported the {what} of {args.run_dir} -> {out}")
    return 0


def generate_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn generate`; errors go to `jaxnn.cli.main`'s exit-status table."""
    if args.length < 1:
        raise ValueError(f"--length must be positive, got {args.length}")
    stop = None if args.stop is None else args.stop.encode()
    if stop is not None and len(stop) != 1:
        raise ValueError(f"--stop must be one byte (a character such as a newline), got {args.stop!r}")

    from jaxnn import compile_cache
    from jaxnn.checkpoint import load_params
    from jaxnn.generate import generate_bytes
    from jaxnn.models.factory import model_from_record

    loaded = load_params(args.run_dir, step=args.step)
    if loaded.config.get("model") != "gpt":
        what = f"a {loaded.config['model']!r} run" if loaded.config.get("model") else "not a run of `jaxnn train`"
        raise ValueError(f"{args.run_dir}: {what}; generate needs a GPT run of `jaxnn train`")
    model, mcfg = model_from_record(loaded.config)
    compile_cache.enable(args.compile_cache)  # most of a short generation is compiling its programs
    text = generate_bytes(
        model,
        loaded.params,
        args.prompt.encode(),
        args.length,
        context_len=mcfg.seq_len if mcfg.position == "learned" else None,
        stop=None if stop is None else stop[0],
        key=args.seed,  # checked by generate: an integer in [0, 2**32)
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        model_state=loaded.model_state,
        policy=loaded.config.get("precision", "fp32"),
    )
    print((args.prompt.encode() + text).decode("utf-8", "replace"))
    return 0
