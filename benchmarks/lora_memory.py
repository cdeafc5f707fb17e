"""LoRA against full fine-tuning: trainable parameters, optimizer state, the step's memory and time, and the
largest model each fits on one 141 GB H200.

    python -m benchmarks.lora_memory [--batch 4] [--seq-len 128] [--ranks 8 16] [--bases int8 nf4] [--steps 3]
                                     [--json out.json]

For a GPT-2-small-shaped model (124M, learned positions, tied embeddings) and a Llama-shaped one (rotary, RMSNorm,
SwiGLU, grouped-query attention; 32k vocabulary), with random weights made here: AdamW over every parameter
(full fine-tuning) against AdamW over LoRA adapters on every attention and MLP weight (r=8, 16), and at the first
rank over a base stored quantised (int8, nf4: `jaxnn.quantized`; embeddings and logits stay fp32). Reported per row:
trainable parameters, the optimizer state's bytes (`tx.init` of the params), XLA's `memory_analysis()` of the
compiled training step (arguments: the whole train state and the batch; temporaries: gradients and activations;
peak = arguments + outputs + temporaries - what the outputs reuse of the donated arguments), the median step
time over `--steps` runs after one warm-up, in fp32 on this CPU, and for a quantised base the relative error of the
model's logits against the fp32 base on the benchmark's batch.

The projection divides 90% of an H200's 141 GB by the bytes each parameter costs in the step (the train state
and gradients; activations excluded, which remat and batch size control): full fine-tuning keeps fp32 weights,
their gradients and two Adam moments (16 bytes per parameter); LoRA keeps the frozen fp32 weights (4 bytes) and
a few adapter bytes; over an int8 or nf4 base the frozen weights cost what they are stored in (codes and scales),
measured on this shape, whose fp32 embeddings weigh more than in a larger model of the same family.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn import lora, quantized
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.models.presets import PRESETS
from jaxnn.train import create_train_state, lm_loss, make_train_step

H200_BYTES = 141e9
USABLE = 0.9  # what is left after the runtime, XLA's workspace and fragmentation, as a round figure

SHAPES = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, num_layers=2, num_heads=2),  # for dry runs
    "gpt2-small": PRESETS["gpt2"].config,
    "llama-shaped": GPTConfig(
        vocab_size=32000,
        seq_len=2048,
        d_model=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        mlp_hidden=2048,
        position="rope",
        norm="rms",
        mlp="swiglu",
        bias=False,
        norm_eps=1e-5,
    ),  # fmt: skip
}


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(
    name: str, cfg: GPTConfig, rank: int | None, batch: int, seq_len: int, steps: int, base: str | None = None
) -> dict:
    """One row: full fine-tuning (`rank` None) or LoRA of that rank, over a base stored as `base` (None: fp32)."""
    settings = None if rank is None else lora.LoRA(rank=rank, alpha=2 * rank, base=base)
    plain = GPT(dataclasses.replace(cfg, seq_len=max(cfg.seq_len, seq_len)))
    model = plain if settings is None else lora.with_adapters(plain, settings)
    adamw = optax.adamw(1e-4)
    tx = adamw if rank is None else lora.train_adapters_only(adamw)
    state = create_train_state(model, tx, jax.random.key(0), (batch, seq_len))
    params = jax.tree.leaves(state.params)  # counted as fp32 weights, before any quantisation
    ids = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, cfg.vocab_size)
    error = 0.0
    if settings is not None and base is not None:
        stored = lora.quantize_base(state.params, settings)
        error = _logits_error(model, state.params, stored, ids[:, :-1])
        state = state._replace(params=stored, opt_state=tx.init(stored))
    if rank is None:
        trainable = sum(x.size for x in params)
    else:
        trainable = sum(np.size(v) for k, v in lora.adapters(state.params).items() if not k.endswith("lora_scale"))
    batch_dict = {"x": ids[:, :-1], "y": ids[:, 1:]}
    step = make_train_step(model, lm_loss, tx)
    compiled = step.lower(state, batch_dict).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    state, _ = compiled(state, batch_dict)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch_dict)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    n_params = sum(x.size for x in params) - (0 if rank is None else trainable + _scales(state.params))
    return {
        "model": name,
        "method": "full" if rank is None else f"lora r={rank}" + (f" {base}" if base else ""),
        "params": int(n_params),
        "trainable": int(trainable),
        "param_bytes": _bytes(state.params),
        "opt_state_bytes": _bytes(state.opt_state),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "peak_bytes": int(peak),
        "step_ms": 1e3 * statistics.median(times),
        "logits_rel_error": error,
    }


def _logits_error(model, params, stored, ids) -> float:
    """||logits(stored) - logits(params)|| / ||logits(params)||: what storing the base quantised costs the model
    (the adapters are zero at the start, so this is the base alone)."""
    full, quant = (np.asarray(jax.jit(model.apply)(p, ids), np.float64) for p in (params, stored))
    return float(np.linalg.norm(quant - full) / np.linalg.norm(full))


def _scales(params) -> int:
    return sum(np.size(v) for k, v in lora.adapters(params).items() if k.endswith("lora_scale"))


def projected_params(row: dict) -> float:
    """The largest parameter count whose state and gradients fit 90% of an H200, at this row's bytes per
    parameter (the weights as stored, plus fp32 gradients and Adam's two moments for what is trained)."""
    per_param = (row["param_bytes"] + (4 + 8) * row["trainable"]) / row["params"]
    return USABLE * H200_BYTES / per_param


def table(rows: list[dict]) -> str:
    head = (f"{'model':<13} {'method':<15} {'logits':>7} {'params':>8} {'trainable':>10} {'weights':>10} "
            f"{'opt state':>10} {'vs full':>8} {'peak MiB':>9} {'temp MiB':>9} {'step ms':>8} "
            f"{'H200 fits':>10}")  # fmt: skip
    lines = [head]
    full = {r["model"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        share = r["opt_state_bytes"] / full[r["model"]]["opt_state_bytes"] if r["model"] in full else float("nan")
        lines.append(
            f"{r['model']:<13} {r['method']:<15} {100 * r['logits_rel_error']:>6.2f}% {r['params'] / 1e6:>7.1f}M "
            f"{r['trainable'] / 1e6:>9.2f}M "
            f"{r['param_bytes'] / 2**20:>8.1f}Mi {r['opt_state_bytes'] / 2**20:>8.1f}Mi {100 * share:>7.2f}% "
            f"{r['peak_bytes'] / 2**20:>9.0f} {r['temp_bytes'] / 2**20:>9.0f} {r['step_ms']:>8.0f} "
            f"{projected_params(r) / 1e9:>8.1f}B"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "llama-shaped"], choices=list(SHAPES))
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bases", nargs="*", default=list(quantized.BASES), choices=list(quantized.BASES),
                        help="quantised bases measured at the first rank (none: --bases with no value)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    add_json_flags(parser)
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    runs = [(rank, None) for rank in (None, *args.ranks)] + [(args.ranks[0], base) for base in args.bases]
    rows = [
        measure(name, SHAPES[name], rank, args.batch, args.seq_len, args.steps, base)
        for name in args.models
        for rank, base in runs
    ]
    print(f"{jax.default_backend()} ({cpu_label()}), jax {jax.__version__}, fp32, AdamW, batch {args.batch} x "
          f"{args.seq_len} tokens, median of {args.steps} steps")  # fmt: skip
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": jax.default_backend(), "cpu": cpu_label(), "args": vars(args), "rows": rows}, f,
                      indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
