"""The tiny model's training step: jaxnn's loss (`train.integer_label_cross_entropy`) against optax's gather-based
one, and Flax Linen's step, side by side; and how XLA's CPU runtime executes each program.

    python -m benchmarks.tiny_step [--precisions fp32 bf16] [--repeats 7]

XLA's CPU runtime runs a program's ops from a ready queue and hands half of it to a second thread whenever more
than a few ops are ready at once; for a step of ~50 ops of a microsecond each, that hand-off and the wait for the
other thread cost more than the ops. The number of ops ready at the start (the execution graph's source nodes,
from XLA's log) is what tipped jaxnn's bf16 tiny step over: printed per variant, with the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from benchmarks.output import add_json_flags, refuse_existing

VARIANTS = ("jaxnn", "jaxnn_optax_ce", "flax_linen")


def build(variant: str, precision: str):
    import optax

    from benchmarks.peers import peer_jaxnn, peer_linen
    from jaxnn import train

    if variant == "flax_linen":
        step = peer_linen.build("tiny", precision)
    else:
        step = peer_jaxnn.build("tiny", precision)
    if variant == "jaxnn_optax_ce":  # traced on the first call: patch around it
        ours = train.integer_label_cross_entropy
        train.integer_label_cross_entropy = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
            logits.astype("float32"), labels
        )
        try:
            step()
        finally:
            train.integer_label_cross_entropy = ours
    step()
    return step


def source_nodes(variant: str, precision: str) -> int | None:
    """The source nodes of the step's execution graph, from XLA's log in a child process (None if not logged)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "thunk_executor=2"}
    code = f"from benchmarks.tiny_step import build; build({variant!r}, {precision!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    counts = [(int(n), int(s)) for n, s in re.findall(r"with (\d+) thunks: #source_nodes=(\d+)", done.stderr)]
    return max(counts)[1] if counts else None  # the step is the largest program the process ran


def main(argv=None) -> int:
    from benchmarks.machine import cpu_label
    from jaxnn.profile.timing import time_interleaved

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiny_step", description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=7)
    add_json_flags(parser, "also write the rows here")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rows = []
    for precision in args.precisions:
        steps = {v: build(v, precision) for v in VARIANTS}
        timing = time_interleaved(steps, repeats=args.repeats)
        for v in VARIANTS:
            rows.append(
                {"precision": precision, "variant": v, "step_ms": timing[v].median * 1e3}
                | {"source_nodes": source_nodes(v, precision)}
            )
    linen = {r["precision"]: r["step_ms"] for r in rows if r["variant"] == "flax_linen"}
    print(f"{'prec':5} {'variant':15} {'ms/step':>9} {'/ Linen':>8} {'ready at start':>15}")
    for r in rows:
        print(
            f"{r['precision']:5} {r['variant']:15} {r['step_ms']:9.4f} {r['step_ms'] / linen[r['precision']]:7.2f}x "
            f"{r['source_nodes'] if r['source_nodes'] is not None else '-':>15}"
        )
    print(f"measured on {cpu_label()}; median of {args.repeats} interleaved windows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_label(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
