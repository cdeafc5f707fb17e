"""Self-attention's forward and backward pass on this CPU: jaxnn's blocked path (the float32 default on CPUs,
`jaxnn.layers.blocked_attention`) with several numbers of query blocks, jax's XLA path, and PyTorch's fused
`scaled_dot_product_attention` where PyTorch is installed.

    python -m benchmarks.attention_cpu [--shapes 16x128x4x64 8x512x4x64 2x1024x8x64] [--blocks 1 4 8 16]
                                       [--no-causal] [--repeats 9] [--json PATH]

Each shape is batch x T x heads x head width (the first is the GPT of `make bench-peers`). Milliseconds for one
forward and backward pass (the value and the gradients of q, k and v), median of interleaved windows, every
variant in this process; PyTorch times its own windows right after, in the same process. `--no-causal`: attention
without a mask (an encoder's), where the blocked path has one block whatever `--blocks` says.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn.layers import blocked_attention
from jaxnn.profile.timing import time_interleaved


def jax_variants(B: int, T: int, N: int, H: int, blocks: list[int], causal: bool = True) -> dict:
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(4))

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def pass_of(fn):
        def forward_and_backward(q, k, v, do):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(do))

        return functools.partial(jax.jit(forward_and_backward), q, k, v, do)

    calls = {"xla": pass_of(xla)}
    for n in blocks if causal else [1]:
        if n <= T:
            split = blocked_attention.even_blocks(T, n)
            calls[f"blocked:{n}"] = pass_of(
                lambda q, k, v, split=split: blocked_attention.attention(q, k, v, None, causal, blocks=split)
            )
    return calls


def torch_ms(B: int, T: int, N: int, H: int, repeats: int, causal: bool = True) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, T, H, generator=gen, requires_grad=True) for _ in range(3))
    do = torch.randn(B, N, T, H, generator=gen)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(do)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x128x4x64", "8x512x4x64", "2x1024x8x64"])
    parser.add_argument("--blocks", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="no mask (default: causal)")
    parser.add_argument("--repeats", type=int, default=9)
    add_json_flags(parser, "write the rows here as JSON")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rows = []
    print(f"{cpu_label()}, jax {jax.__version__}; ms per forward + backward pass, median")
    for shape in args.shapes:
        B, T, N, H = (int(x) for x in shape.split("x"))
        timings = time_interleaved(jax_variants(B, T, N, H, args.blocks, args.causal), repeats=args.repeats)
        row = {"shape": {"batch": B, "seq_len": T, "heads": N, "head_dim": H}, "causal": args.causal}
        row["ms"] = {name: t.median * 1e3 for name, t in timings.items()}
        row["default_blocks"] = len(blocked_attention.query_blocks(T, T, causal=args.causal))
        torch_time = torch_ms(B, T, N, H, args.repeats, args.causal)
        if torch_time is not None:
            row["ms"]["pytorch_sdpa"] = torch_time
        rows.append(row)
        xla = row["ms"]["xla"]
        cells = "  ".join(f"{name} {ms:.2f} ({ms / xla:.2f}x)" for name, ms in row["ms"].items())
        print(f"{shape:14} default {row['default_blocks']} blocks: {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_label(), "jax": jax.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
