"""Side by side: the bf16 GPT train step with its products in the bf16 form and widened to float32, against fp32
and Flax Linen, in one process (interleaved windows, medians).

Run: `python -m benchmarks.ab_widened_bf16 --isa avx2 [--rounds N]`. Variants, all on the
`make bench` GPT and batch (benchmarks/train_steps.py):
- jaxnn fp32: the default fp32 step;
- jaxnn bf16, bf16 form: every bf16 product a bf16 x bf16 -> f32 dot (what a CPU with bf16 instructions runs);
- jaxnn bf16, widened: the products as float32 products of the widened operands (`jaxnn._src.widened_products`,
  the default on a CPU without bf16 instructions);
- jaxnn fp16: float16 operands (no CPU widens them for XLA, which converts them itself);
- flax linen fp32 and bf16: the `make bench-peers` Linen steps.
Each jaxnn bf16 variant is traced with the choice forced either way, so both run on any CPU; `--isa avx2` holds
XLA, oneDNN and (under gdb) YNNPACK to AVX2, the code an AVX2-only CPU runs. Figures and what they decided:
docs/performance.md, "bf16 on CPUs without bf16 instructions".
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from benchmarks.output import print_rounds
from benchmarks.peers import peer_jaxnn, peer_linen
from jaxnn._src import widened_products


def traced_with(widened: bool, name: str):
    """The jaxnn bf16 step of `name`, traced (by one call) with the products widened or in their bf16 form."""
    with mock.patch.object(widened_products, "host_bf16_products", lambda: not widened):
        fn = peer_jaxnn.build(name, "bf16")
        jax.block_until_ready(fn())
    return fn


def variants(name: str) -> dict:
    return {
        "jaxnn fp32": peer_jaxnn.build(name, "fp32"),
        "jaxnn bf16, bf16 form": traced_with(False, name),
        "jaxnn bf16, widened": traced_with(True, name),
        "jaxnn fp16": peer_jaxnn.build(name, "fp16"),
        "flax linen fp32": peer_linen.build(name, "fp32"),
        "flax linen bf16": peer_linen.build(name, "bf16"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="gpt", choices=["mlp", "gpt"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="timing windows per variant and round")
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    print(f"median ms of {args.repeats} interleaved windows, ratio to flax linen bf16; {cpu_label()}, "
          f"jax {jax.__version__}")  # fmt: skip
    fns = variants(args.model)
    print_rounds(args.model, fns, "flax linen bf16", args.rounds, warmup=1, repeats=args.repeats, min_window_s=0.0)


if __name__ == "__main__":
    main()
