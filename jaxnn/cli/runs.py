"""`jaxnn export` and `jaxnn generate`: what a finished run is used for."""

from __future__ import annotations

import argparse
from typing import Any

from jaxnn.cli.parsers import add_command


def add_export_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "export",
        help="export a trained model for inference without jaxnn",
        description="Write a run's checkpoint as model.jaxexport (a serialized jax.export program with a symbolic "
        "batch size), weights.safetensors and export.json (shapes, dtypes, how to call it).",
    )
    p.add_argument(
        "--run-dir",
        required=True,
        help="run directory of `jaxnn train` (or its ckpt/ or a step folder), or a jaxnn.save_model folder",
    )
    p.add_argument(
        "--input-shape",
        default=None,
        metavar="D,D,...",
        help="one example's shape (no batch axis) for a saved model that records none; float32 (int32 with "
        "--input-dtype)",
    )
    p.add_argument("--input-dtype", default="float32", help="dtype of --input-shape's input")
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
        choices=("jax", "hf", "lora", "peft"),
        help="jax: a jax.export program and its weights; hf: a Hugging Face transformers folder (GPT runs: GPT-2 "
        "for learned positions, Llama for rotary ones, with the run's tokenizer); both merge LoRA adapters into "
        "their weights. lora: a LoRA run's adapters alone, as adapters.safetensors (jaxnn.lora.load_adapters); "
        "peft: a GPT LoRA run's adapters alone in PEFT's layout, for PeftModel.from_pretrained and vLLM on the "
        "transformers folder of its base (jaxnn.interop.peft)",
    )


def add_generate_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "generate",
        help="print text sampled from a trained GPT run",
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
    p.add_argument("--prompt", default="def ", help="text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true", help="send --prompt as a user message through the checkpoint's "
                   "chat template, and print the assistant's answer")  # fmt: skip
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template for --chat where "
                   "the checkpoint's folder has none")  # fmt: skip
    p.add_argument("--length", type=int, default=200, help="bytes (tokens, with a tokenizer) to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely bytes of this total mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest readable one)")
    p.add_argument(
        "--stop",
        default=None,
        metavar="CHAR",
        help="end after this one-byte character (e.g. a newline), or this token with a tokenizer",
    )
    p.add_argument(
        "--compile-cache",
        default="auto",
        metavar="DIR",
        help="jax's persistent compilation cache: 'auto' ($JAXNN_COMPILE_CACHE, else ~/.cache/jaxnn/xla), 'off' or "
        "a directory",
    )


def export_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn export`; errors go to `jaxnn.cli.main`'s exit-status table."""
    from jaxnn.saving import is_saved_model

    if is_saved_model(args.run_dir):
        return _export_saved(args)
    if args.input_shape is not None:
        raise ValueError("--input-shape is for a saved model; a run's input shape is its data set's")
    if args.format == "hf":
        return _export_hf(args)
    if args.format in ("lora", "peft"):
        return _export_adapters(args)
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
    from jaxnn._src import compile_cache
    from jaxnn.interop.hf import is_hf_folder

    if is_hf_folder(args.run_dir):
        compile_cache.enable(args.compile_cache)
        return _generate_hf(args)
    from jaxnn.checkpoint import load_params
    from jaxnn.interop.tokenizer import TOKENIZER_FILE, load_tokenizer, run_tokenizer_folder, special_token_ids
    from jaxnn.models.factory import model_from_record

    loaded = load_params(args.run_dir, step=args.step)
    if loaded.config.get("model") != "gpt":
        what = f"a {loaded.config['model']!r} run" if loaded.config.get("model") else "not a run of `jaxnn train`"
        raise ValueError(f"{args.run_dir}: {what}; generate needs a GPT run of `jaxnn train`")
    model, mcfg = model_from_record(loaded.config)
    folder = run_tokenizer_folder(loaded.config, loaded.directory)  # the one the run was trained with, checked
    tokenizer = None if folder is None else load_tokenizer(folder / TOKENIZER_FILE)
    if tokenizer is None and mcfg.vocab_size != 256:
        raise ValueError(
            f"{args.run_dir}: the model has {mcfg.vocab_size} token ids and the run recorded no tokenizer; "
            "generate reads text as bytes only for a 256-id vocabulary"
        )
    compile_cache.enable(args.compile_cache)  # most of a short generation is compiling its programs
    ids = {} if folder is None else special_token_ids(folder, mcfg.vocab_size)
    _print_generation(args, model, loaded.params, loaded.model_state, tokenizer, mcfg, folder=folder,
                      policy=loaded.config.get("precision", "fp32"), ids=ids)  # fmt: skip
    return 0


def _print_generation(args, model, params, model_state, tokenizer, mcfg, *, policy="fp32", ids=None, folder=None):
    """Prints the prompt and its continuation, which ends at `--stop`, else at the checkpoint's end-of-text id
    (`ids`: its special token ids, `interop.tokenizer.special_token_ids`), else after `--length` tokens. With
    `--chat`, the prompt is a user message in the chat template of `folder` (or `--chat-template`), and only the
    answer is printed."""
    from jaxnn.generate import generate_text, generate_tokens
    from jaxnn.interop.tokenizer import first_end_id

    ids = ids or {}
    end_id = first_end_id(ids)
    sampling = {
        "context_len": mcfg.seq_len if mcfg.position == "learned" else None,
        "key": args.seed,  # checked by generate: an integer in [0, 2**32)
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "model_state": model_state,
        "policy": policy,
    }
    if not args.chat:
        print(generate_text(model, params, args.prompt, args.length, tokenizer=tokenizer, stop=args.stop,
                            bos_id=ids.get("bos_token_id"), end_id=end_id, **sampling))  # fmt: skip
        return
    text = _chat_prompt(args, folder)
    # The template writes its special tokens itself: the text is tokenised without adding any.
    prompt = list(text.encode()) if tokenizer is None else tokenizer.encode(text, add_special_tokens=False).ids
    new = generate_tokens(model, params, prompt, args.length, stop=end_id, **sampling)
    new = new[:-1] if new and new[-1] == end_id else new
    print(bytes(new).decode("utf-8", "replace") if tokenizer is None else tokenizer.decode(new))


def _chat_prompt(args: argparse.Namespace, folder: Any) -> str:
    """--prompt as the user's message, rendered with the chat template, the assistant's turn opened."""
    from jaxnn.interop.chat import ChatTemplate

    template = ChatTemplate.from_folder(folder, args.chat_template)
    if template is None:
        raise ValueError(f"--chat: {args.run_dir} has no chat template; give one with --chat-template FILE")
    return template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)


def _export_hf(args: argparse.Namespace) -> int:
    """`jaxnn export --format hf`: a GPT run's checkpoint as a folder `transformers` loads."""
    from jaxnn.checkpoint import load_params
    from jaxnn.interop.hf import save_hf
    from jaxnn.interop.tokenizer import run_tokenizer_folder
    from jaxnn.models.factory import model_from_record

    loaded = load_params(args.run_dir, step=args.step)
    if loaded.config.get("model") != "gpt":
        raise ValueError(f"{args.run_dir}: --format hf writes GPT runs, not a {loaded.config.get('model')!r} run")
    _, cfg = model_from_record(loaded.config)
    tokenizer = run_tokenizer_folder(loaded.config, loaded.directory)  # refused before anything is written
    out = save_hf(args.out, cfg, loaded.params, tokenizer_from=tokenizer, source=_source(loaded))
    print(f"jaxnn: exported {args.run_dir} as a transformers folder -> {out}")
    return 0


def _export_adapters(args: argparse.Namespace) -> int:
    """`jaxnn export --format lora`: the adapters of a LoRA run (not its base) as one small file."""
    from jaxnn._src.folders import write_folder
    from jaxnn.checkpoint import load_params
    from jaxnn.lora import as_lora, save_adapters

    loaded = load_params(args.run_dir, step=args.step)
    if "lora" not in loaded.config:
        raise ValueError(f"{args.run_dir}: not a LoRA run (trained without --lora): it has no adapters to export")
    settings = as_lora(loaded.config["lora"])
    if args.format == "peft":
        return _export_peft(args, loaded, settings)
    out = write_folder(
        args.out,
        lambda staging: save_adapters(staging / "adapters.safetensors", loaded.params, settings),
        {"format": "lora adapters", "source": _source(loaded)},
    )
    print(f"jaxnn: exported the LoRA adapters of {args.run_dir} -> {out / 'adapters.safetensors'}")
    return 0


def _export_peft(args: argparse.Namespace, loaded: Any, settings: Any) -> int:
    """`jaxnn export --format peft`: a GPT LoRA run's adapters as a PEFT folder, for the base it started from."""
    from jaxnn.interop.hf import is_hf_folder
    from jaxnn.interop.peft import save_peft
    from jaxnn.models.factory import model_from_record

    if loaded.config.get("model") != "gpt":
        raise ValueError(
            f"{args.run_dir}: --format peft writes GPT runs' adapters, not a {loaded.config.get('model')!r} run"
        )
    _, cfg = model_from_record(loaded.config)
    # The transformers folder the run started from, where the record names one: PEFT's base_model_name_or_path.
    candidates = [loaded.config.get("init_from"), (loaded.config.get("tokenizer") or {}).get("source")]
    base = next((c for c in candidates if isinstance(c, str) and is_hf_folder(c)), None)
    out = save_peft(args.out, cfg, loaded.params, settings, base_model=base, source=_source(loaded))
    print(f"jaxnn: exported the LoRA adapters of {args.run_dir} in PEFT's layout -> {out}")
    return 0


def _export_saved(args: argparse.Namespace) -> int:
    """`jaxnn export` of a `jaxnn.save_model` folder: jax (with its recorded input shape) or hf (a saved GPT)."""
    from jaxnn.saving import export_saved_model

    if args.format in ("lora", "peft"):
        raise ValueError(f"{args.run_dir}: --format {args.format} exports a LoRA run's adapters; a saved model "
                         "holds merged weights (use --format jax or hf)")  # fmt: skip
    if args.step is not None:
        raise ValueError(f"--step {args.step}: {args.run_dir} is a saved model, which holds one state; drop --step")
    if args.format == "hf":
        return _export_saved_hf(args)
    spec = None
    if args.input_shape is not None:
        try:
            spec = (tuple(int(d) for d in args.input_shape.split(",")), args.input_dtype)
        except ValueError:
            raise ValueError(f"--input-shape must be integers separated by commas, got {args.input_shape!r}") from None
    out = export_saved_model(
        args.run_dir, args.out, platforms=args.platforms, safetensors_only=args.safetensors_only, input_spec=spec
    )
    print(f"jaxnn: exported the saved model {args.run_dir} -> {out}")
    return 0


def _export_saved_hf(args: argparse.Namespace) -> int:
    import pathlib

    from jaxnn.interop.hf import save_hf
    from jaxnn.lora import merge
    from jaxnn.models import GPTConfig
    from jaxnn.saving import load_model

    model, params, _ = load_model(args.run_dir)
    spec = model.spec
    if spec is None or not spec.path.endswith(".GPT"):
        raise ValueError(f"{args.run_dir}: --format hf writes GPT models; this saved model is a {model.name!r}")
    cfg = spec.args[0] if spec.args else spec.kwargs.get("cfg", GPTConfig())
    source = str(pathlib.Path(args.run_dir).absolute())
    out = save_hf(args.out, cfg, merge(params), source=source)
    print(f"jaxnn: exported the saved model {args.run_dir} as a transformers folder -> {out}")
    return 0


def _source(loaded: Any) -> str:
    """What an export folder records as its source: the checkpoint directory it was written from, so a rerun (of
    any step of that run) replaces its own earlier export and never another's."""
    return str(loaded.directory.absolute())


def _generate_hf(args: argparse.Namespace) -> int:
    """`jaxnn generate` from a transformers GPT-2/Llama folder, tokenised with its tokenizer.json if it has one."""
    import pathlib

    import jax

    from jaxnn.interop.hf import load_hf
    from jaxnn.interop.tokenizer import TOKENIZER_FILE, load_tokenizer, special_token_ids
    from jaxnn.models import GPT

    folder = pathlib.Path(args.run_dir)
    cfg, params = load_hf(folder)
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE) if (folder / TOKENIZER_FILE).is_file() else None
    if tokenizer is None and cfg.vocab_size != 256:
        raise ValueError(
            f"{folder}: no {TOKENIZER_FILE}, and its {cfg.vocab_size}-token vocabulary cannot read text as bytes"
        )
    ids = special_token_ids(folder, cfg.vocab_size)
    _print_generation(args, GPT(cfg), jax.tree.map(jax.numpy.asarray, params), None, tokenizer, cfg, folder=folder,
                      ids=ids)  # fmt: skip
    return 0
