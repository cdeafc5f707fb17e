"""Greedy text generation from a decoding export (`jaxnn.decoding_export.write_decoding_export`), with numpy,
jax and safetensors only: jaxnn is not imported.

    python examples/generate_exported.py EXPORT_DIR "first prompt" "another" [--new-tokens 40] [--stop '\n']
        [--json out.json]

    python examples/generate_exported.py --smoke   # makes a tiny random-weight export with jaxnn first

The prompts are byte strings for a byte-level model (vocabulary 256). They are left-padded to the export's prompt
length and decoded as one batch: the prefill program fills the cache, then the step program is called once per
new token, each row at its own position. A row ends at its stop byte or after --new-tokens.
"""

import argparse
import json
import pathlib

import jax
import numpy as np
import safetensors.numpy


def load(export_dir: pathlib.Path) -> tuple:
    info = json.loads((export_dir / "decoding.json").read_text())
    prefill = jax.export.deserialize((export_dir / "prefill.jaxexport").read_bytes())
    step = jax.export.deserialize((export_dir / "step.jaxexport").read_bytes())
    weights = safetensors.numpy.load_file(export_dir / "weights.safetensors")
    return info, prefill, step, weights


def generate(export_dir: pathlib.Path, prompts: list[bytes], new_tokens: int, stop: int | None) -> list[bytes]:
    info, prefill, step, weights = load(export_dir)
    T, room = info["prompt_len"], info["cache_len"] - info["prompt_len"]
    if max(map(len, prompts)) > T or min(map(len, prompts)) < 1 or new_tokens > room:
        raise SystemExit(f"prompts must be 1..{T} bytes and --new-tokens at most {room} for this export")
    ids = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros((len(prompts), T), bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = list(p), True
    logits, *cache = prefill.call(weights, ids, mask)
    positions = mask.sum(axis=1).astype(np.int32)  # where each row's next token goes
    out = np.zeros((len(prompts), new_tokens), np.int32)
    done = np.zeros(len(prompts), bool)
    lengths = np.zeros(len(prompts), int)
    for j in range(new_tokens):
        token = np.asarray(logits).argmax(axis=-1).astype(np.int32)
        out[:, j] = np.where(done, 0, token)
        lengths += ~done
        done |= token == stop if stop is not None else False
        if done.all() or j == new_tokens - 1:
            break
        logits, *cache = step.call(weights, token, positions, *cache)
        positions = positions + 1
    return [bytes(row[:n].astype(np.uint8)) for row, n in zip(out, lengths)]


def smoke_export(out: pathlib.Path) -> pathlib.Path:
    """A tiny GPT's decoding export, random weights: the only place this script uses jaxnn."""
    from jaxnn.decoding_export import write_decoding_export
    from jaxnn.models import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=48, d_model=32, num_layers=1, num_heads=2))
    _, params = model.init(jax.random.key(0), (1, 8))
    return write_decoding_export(out, model, params, prompt_len=8, cache_len=48)  # room for 40 new tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=pathlib.Path, nargs="?")
    parser.add_argument("prompts", nargs="*")
    parser.add_argument("--smoke", action="store_true", help="export a tiny random GPT to ./smoke-export first")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--stop", default=None, help="one byte that ends a row (included in its output)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the new tokens per row here")
    args = parser.parse_args()
    if args.smoke:
        args.export_dir, args.prompts = smoke_export(pathlib.Path("smoke-export")), ["def ", "x"]
    if args.export_dir is None or not args.prompts:
        parser.error("give an export directory and at least one prompt (or --smoke)")
    stop = None if args.stop is None else args.stop.encode().decode("unicode_escape").encode("latin-1")[0]
    texts = generate(args.export_dir, [p.encode() for p in args.prompts], args.new_tokens, stop)
    for prompt, text in zip(args.prompts, texts):
        print(repr(prompt), "->", repr(text.decode("utf-8", "replace")))
    if args.json:
        args.json.write_text(json.dumps([list(t) for t in texts]))


if __name__ == "__main__":
    main()
