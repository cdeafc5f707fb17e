"""Rematerialisation policies: the training step's peak memory and time per policy, as the sequence grows.

    python -m benchmarks.remat_memory [--seq-lens 512 1024 2048 4096] [--steps 2] [--json out.json]

A GPT (width 128, 4 blocks of 4 heads, scanned: `scan_layers=True`; byte vocabulary) at batch 1, fp32, one gradient
step (`jax.grad` of the next-token loss, what the train step spends its memory on), compiled per policy of
`jaxnn.layers.REMAT_POLICIES` and without remat (`--unrolled`: the blocks unrolled instead). Reported per row: XLA's
`memory_analysis()` temporaries (the activations kept for the backward pass and the gradients' work space: what a
policy changes), the median step time over `--steps` runs after one warm-up on this CPU, and the projected H200 time
of the same compiled program (`jaxnn.profile.projection`: max(FLOPs / peak, bytes / bandwidth); projected, not
measured). Unrolled, XLA's CPU scheduler runs the recomputations early and holds about as much as without remat
(docs/performance.md, "Rematerialisation").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn.layers import REMAT_POLICIES, init_model
from jaxnn.models import GPT, GPTConfig
from jaxnn.profile.projection import accelerator
from jaxnn.profile.timing import cost_counts
from jaxnn.train import lm_loss

POLICIES = ("none", *REMAT_POLICIES)


def _step(seq_len: int, policy: str, scan: bool = True):
    cfg = GPTConfig(seq_len=seq_len, d_model=128, num_layers=4, num_heads=4, scan_layers=scan,
                    remat=False if policy == "none" else policy)  # fmt: skip
    model = GPT(cfg)

    def loss(params, x):
        return lm_loss(model.apply(params, x[:, :-1]), {"y": x[:, 1:]})[0]

    return model, jax.jit(jax.grad(loss))


def measure(seq_len: int, policy: str, steps: int, scan: bool = True) -> dict:
    model, grad = _step(seq_len, policy, scan)
    _, params, _ = init_model(model, jax.random.key(0), (1, seq_len))
    x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, seq_len + 1)), jnp.int32)
    compiled = grad.lower(params, x).compile()
    jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - start)
    flops, nbytes = cost_counts(compiled)
    return {
        "seq_len": seq_len,
        "policy": policy,
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "step_ms": statistics.median(times) * 1e3,
        "h200_projected_ms": accelerator().lower_bound(flops, nbytes, jnp.float32) * 1e3,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remat_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--unrolled", action="store_true", help="the blocks unrolled (scan_layers=False)")
    add_json_flags(parser)
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rows = [measure(n, p, args.steps, not args.unrolled) for n in args.seq_lens for p in args.policies]
    blocks = "unrolled" if args.unrolled else "scanned"
    print(f"{cpu_label()}; jax {jax.__version__}; GPT d128 x 4 blocks ({blocks}), batch 1, fp32 gradient step")
    print(f"{'seq':>5} {'policy':<14} {'temp MiB':>9} {'step ms':>9} {'H200 ms (projected)':>20}")
    for r in rows:
        print(f"{r['seq_len']:>5} {r['policy']:<14} {r['temp_mib']:>9.1f} {r['step_ms']:>9.1f} "
              f"{r['h200_projected_ms']:>20.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_label(), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
