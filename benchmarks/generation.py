"""Greedy generation speed: jaxnn with and without the KV cache, side by side with Hugging Face `transformers`'
`generate` (PyTorch, CPU) on the same weights when it is installed.

    python -m benchmarks.generation [--size gpt2-small|small] [--prompt 64] [--new-tokens 64] [--batch 1 8]
        [--rounds 3] [--no-cache-batches 1] [--json out.json]

The model is GPT-2-small-shaped by default (d 768, 12 layers, 12 heads, vocabulary 50257, 1024 positions; random
weights, fp32), built in jaxnn and copied into `transformers.GPT2LMHeadModel` (untied head, no head bias, jaxnn's
GELU and LayerNorm epsilon), so both compute the same function: the prompt's logits are compared, and how many rows
give the same greedy tokens. Per batch size: tokens/s over the new tokens (median of interleaved rounds), time to
the first token (a generation of one token), and the first call (jaxnn's compile) apart. The runs without a cache
recompute the whole sequence per token; they are slow, so only `--no-cache-batches` take them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from benchmarks.output import add_json_flags, params_label, refuse_existing
from jaxnn.generate import generate_batch
from jaxnn.models import GPT, GPTConfig

SIZES = {
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, num_layers=12, num_heads=12),
    "small": GPTConfig(vocab_size=256, seq_len=256, d_model=128, num_layers=2, num_heads=4),
}
LN_EPS = 1e-6  # jaxnn's LayerNorm default, given to transformers too


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def jaxnn_runners(model, params, prompt: np.ndarray, n: int, no_cache: bool) -> dict[str, Callable[[], Any]]:
    rows = list(prompt)
    runs = {
        "jaxnn cache": lambda: generate_batch(model, params, rows, n).tokens,
        "jaxnn cache ttft": lambda: generate_batch(model, params, rows, 1).tokens,
    }
    if no_cache:
        runs["jaxnn no cache"] = lambda: generate_batch(model, params, rows, n, use_cache=False).tokens
    return runs


def to_transformers(cfg: GPTConfig, params: Any) -> Any:
    """A GPT2LMHeadModel holding jaxnn's weights (fp32, eval mode)."""
    import torch
    import transformers

    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        activation_function="gelu_new",  # the tanh approximation, jaxnn's Gelu
        layer_norm_epsilon=LN_EPS,
        tie_word_embeddings=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    p = jax.tree.map(lambda a: torch.from_numpy(np.array(a, np.float32)), params)
    sd = {"transformer.wte.weight": p["0_embed"]["table"], "transformer.wpe.weight": p["1_pos_embed"]["table"]}
    for i in range(cfg.num_layers):
        block, h = p[f"{i + 2}_block"], f"transformer.h.{i}."
        attn, mlp = block["0_attn"], block["1_mlp"]
        pairs = {
            "ln_1": (attn["0_ln"]["scale"], attn["0_ln"]["bias"]),
            "attn.c_attn": (attn["1_attention"]["qkv"]["w"], attn["1_attention"]["qkv"]["b"]),
            "attn.c_proj": (attn["1_attention"]["out"]["w"], attn["1_attention"]["out"]["b"]),
            "ln_2": (mlp["0_ln"]["scale"], mlp["0_ln"]["bias"]),
            "mlp.c_fc": (mlp["1_fc"]["w"], mlp["1_fc"]["b"]),
            "mlp.c_proj": (mlp["3_proj"]["w"], mlp["3_proj"]["b"]),
        }
        for name, (w, b) in pairs.items():  # GPT-2's Conv1D stores weights (in, out), as jaxnn's Dense does
            sd[h + name + ".weight"], sd[h + name + ".bias"] = w, b
    last = cfg.num_layers + 2
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = p[f"{last}_ln_f"]["scale"], p[f"{last}_ln_f"]["bias"]
    sd["lm_head.weight"] = p[f"{last + 1}_logits"]["w"].T.contiguous()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if not k.endswith("attn.bias")]:
        raise RuntimeError(f"transformers GPT-2 weights do not line up: missing {missing}, unexpected {unexpected}")
    return hf


def transformers_runners(hf, prompt: np.ndarray, n: int, no_cache: bool) -> dict[str, Callable[[], Any]]:
    import torch

    ids = torch.from_numpy(prompt.astype(np.int64))
    mask = torch.ones_like(ids)

    def run(new: int, use_cache: bool = True) -> np.ndarray:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].numpy()

    runs = {"transformers cache": lambda: run(n), "transformers cache ttft": lambda: run(1)}
    if no_cache:
        runs["transformers no cache"] = lambda: run(n, use_cache=False)
    return runs


def measure(batch: int, cfg: GPTConfig, model, params, hf, args: argparse.Namespace) -> dict:
    prompt = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, args.prompt))
    no_cache = batch in args.no_cache_batches
    runs = jaxnn_runners(model, params, prompt, args.new_tokens, no_cache)
    if hf is not None:
        runs |= transformers_runners(hf, prompt, args.new_tokens, no_cache)
    first = {name: timed(fn) for name, fn in runs.items()}  # jaxnn: compile + one run
    tokens = {name: np.asarray(fn()) for name, fn in runs.items() if "ttft" not in name}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    row: dict[str, Any] = {"batch": batch, "first_call_s": first, "median_s": medians}
    row["tokens_per_s"] = {k: batch * args.new_tokens / t for k, t in medians.items() if "ttft" not in k}
    row["ttft_s"] = {k.removesuffix(" ttft"): t for k, t in medians.items() if "ttft" in k}
    reference = tokens["jaxnn cache"]
    row["rows_equal_to_jaxnn_cache"] = {k: int((v == reference).all(axis=1).sum()) for k, v in tokens.items()}
    return row


def logits_gap(model, params, hf, cfg: GPTConfig) -> float:
    """The largest |jaxnn - transformers| prompt logit, relative to the largest logit."""
    import torch

    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32))
    ours = np.asarray(jax.jit(model.apply)(params, x))
    with torch.inference_mode():
        theirs = hf(torch.from_numpy(x)).logits.numpy()
    return float(np.abs(ours - theirs).max() / np.abs(ours).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--no-cache-batches", type=int, nargs="*", default=[1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true", help="jaxnn only, even if transformers is here")
    add_json_flags(parser)
    args = parser.parse_args()
    refuse_existing(args.json, overwrite=args.overwrite)
    cfg = SIZES[args.size]
    model = GPT(cfg)
    _, params = jax.jit(lambda k: model.init(k, (1, 8)))(jax.random.key(0))
    hf = None
    if not args.no_transformers:
        try:
            import torch  # noqa: F401

            hf = to_transformers(cfg, params)
        except ImportError:
            print("transformers or torch not installed: jaxnn only (pip install -e '.[bench]')")
    gap = logits_gap(model, params, hf, cfg) if hf is not None else None
    rows = [measure(b, cfg, model, params, hf, args) for b in args.batch]
    threads = None
    if hf is not None:
        import torch

        threads = torch.get_num_threads()
    print(
        f"{args.size} ({params_label(cfg.num_params())} params), fp32, greedy; prompt {args.prompt}, {args.new_tokens} "
        f"new tokens; {cpu_name()}, {os.cpu_count()} CPUs, jax {jax.__version__}"
        + (f", torch threads {threads}; prompt logits |jaxnn - transformers| / max = {gap:.1e}" if hf else "")
    )
    print(f"{'batch':>5} {'run':<22} {'tokens/s':>9} {'ttft ms':>8} {'first call s':>12} {'rows = jaxnn':>12}")
    for r in rows:
        for name in r["tokens_per_s"]:
            ttft = r["ttft_s"].get(name)
            print(
                f"{r['batch']:>5} {name:<22} {r['tokens_per_s'][name]:>9.1f} "
                f"{'' if ttft is None else f'{ttft * 1e3:.0f}':>8} {r['first_call_s'][name]:>12.1f} "
                f"{r['rows_equal_to_jaxnn_cache'][name]:>8}/{r['batch']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            info = {"cpu": cpu_name(), "jax": jax.__version__, "args": vars(args), "logits_gap": gap, "rows": rows}
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
