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
    p.add_argument(
        "--format",
        default="jax",
        choices=("jax", "hf"),
        help="jax: a jax.export program and its weights; hf: a Hugging Face transformers folder (GPT runs: GPT-2 "
        "for learned positions, Llama for rotary ones)",
    )


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="print text sampled from a trained GPT run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Continue a prompt with the newest (or --step's) checkpoint of a `jaxnn train --model gpt` run, "
        "or with a Hugging Face GPT-2 or Llama folder (its tokenizer.json where it has one, else bytes), "
        "decoding with a KV cache. Prompt and output lengths are rounded up to powers of two, so a new prompt length "
        "reuses a compiled program, which the persistent compile cache keeps for the next run.",
    )
    p.add_argument(
        "--run-dir",
        required=True,
        help="run directory of `jaxnn train` (or its ckpt/ or a step folder), or a transformers checkpoint folder",
    )
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--length", type=int, default=200, help="bytes (tokens, with a tokenizer) to generate")
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
    if args.format == "hf":
        return _export_hf(args)
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

    from jaxnn._src import compile_cache
    from jaxnn.checkpoint import load_params
    from jaxnn.generate import generate_bytes
    from jaxnn.interop.hf import is_hf_folder
    from jaxnn.models.factory import model_from_record

    if is_hf_folder(args.run_dir):
        compile_cache.enable(args.compile_cache)
        return _generate_hf(args)
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


def _export_hf(args: argparse.Namespace) -> int:
    """`jaxnn export --format hf`: a GPT run's checkpoint as a folder `transformers` loads."""
    from jaxnn.checkpoint import load_params
    from jaxnn.interop.hf import save_hf
    from jaxnn.models.factory import model_from_record

    loaded = load_params(args.run_dir, step=args.step)
    if loaded.config.get("model") != "gpt":
        raise ValueError(f"{args.run_dir}: --format hf writes GPT runs, not a {loaded.config.get('model')!r} run")
    _, cfg = model_from_record(loaded.config)
    out = save_hf(args.out, cfg, loaded.params)
    print(f"jaxnn: exported {args.run_dir} as a transformers folder -> {out}")
    return 0


def _generate_hf(args: argparse.Namespace) -> int:
    """`jaxnn generate` from a transformers GPT-2/Llama folder, tokenised with its tokenizer.json if it has one."""
    import pathlib
    import sys

    import jax

    from jaxnn.generate import generate_batch
    from jaxnn.interop.hf import load_hf, read_hf_config
    from jaxnn.models import GPT

    folder = pathlib.Path(args.run_dir)
    cfg, params = load_hf(folder)
    tokenizer = _tokenizer(folder)
    ids = tokenizer.encode(args.prompt).ids if tokenizer else list(args.prompt.encode())
    eos = read_hf_config(folder).get("eos_token_id")
    stop = args.stop and (tokenizer.token_to_id(args.stop) if tokenizer else ord(args.stop))
    new = generate_batch(
        GPT(cfg),
        jax.tree.map(jax.numpy.asarray, params),
        [ids or [eos if isinstance(eos, int) else 0]],
        args.length,
        stop_tokens=stop if isinstance(stop, int) else None,
        key=args.seed,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    tokens = [int(t) for t in new.tokens[0][: int(new.lengths[0])]]
    if tokenizer is not None:
        unknown = sum(t >= tokenizer.get_vocab_size() for t in tokens)
        if unknown:
            print(
                f"jaxnn: {unknown} of {len(tokens)} new ids are outside tokenizer.json's {tokenizer.get_vocab_size()} "
                f"tokens (the model has {cfg.vocab_size}): they print as nothing",
                file=sys.stderr,
            )
        print(tokenizer.decode(ids + tokens))
    else:  # a byte-level reading: ids past 255 are not bytes
        print(bytes(t for t in ids + tokens if t < 256).decode("utf-8", "replace"))
    return 0


def _tokenizer(folder: Any) -> Any:
    """The folder's `tokenizers` tokenizer (tokenizer.json), or None: the prompt is then read as bytes."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from jaxnn._src.optional import require

    return require("tokenizers", "reading a checkpoint's tokenizer.json").Tokenizer.from_file(str(path))
