"""One GPT training step in each precision policy and attention implementation, timed side by side on this device:
which variant a user should pick here, and where a policy costs more than it saves.

`python -m benchmarks.step_variants [--size small|large|bench|tiny] [--variants fp32:xla bf16:auto fp8:auto ...]
[--json PATH] [--trace-dir DIR] [--hlo-dir DIR]`. Sizes: `small` is REPORT.md's GPU training model (d=512, 6 layers,
T=256, batch 64), `large` the MFU benchmark's (d=1024, 24 layers, T=1024, batch 16), `bench` the GPT of `make
bench-peers` (d=256, 4 layers, T=128, batch 16), `tiny` a CPU smoke size. Each variant compiles once (no
donation, so every timing window runs the same step on the same state); the medians come from interleaved rounds.
`--trace-dir` also writes a jax profiler trace (Perfetto JSON) of a few steps of each variant, `--hlo-dir` each
compiled program's HLO: the evidence for why one variant is slower than another.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.output import add_json_flags, refuse_existing
from experiments.common import library_calls, machine_info
from jaxnn import train
from jaxnn.models import GPT, GPTConfig
from jaxnn.profile.timing import time_interleaved

SIZES = {
    "tiny": {"batch": 4, "seq_len": 32, "d_model": 64, "num_layers": 2, "num_heads": 2},
    "bench": {"batch": 16, "seq_len": 128, "d_model": 256, "num_layers": 4, "num_heads": 4},
    "small": {"batch": 64, "seq_len": 256, "d_model": 512, "num_layers": 6, "num_heads": 8},
    "large": {"batch": 16, "seq_len": 1024, "d_model": 1024, "num_layers": 24, "num_heads": 16},
}
DEFAULT_VARIANTS = ["bf16:auto", "fp32:auto", "fp8:auto", "bf16:xla", "bf16:f32acc"]


def build(size: dict, variant: str):
    """The compiled training step of `variant` ("precision:attention"), its state and batch."""
    policy, attention = variant.split(":")
    cfg = GPTConfig(
        vocab_size=256,
        attention_implementation=attention,
        **{k: size[k] for k in ("seq_len", "d_model", "num_layers", "num_heads")},
    )
    model = GPT(cfg)
    tokens = np.random.default_rng(0).integers(0, 256, (size["batch"], size["seq_len"] + 1), dtype=np.int32)
    batch = {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
    tx = optax.adamw(3e-4, weight_decay=0.1, mask=train.weight_decay_mask)
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, policy)
    step = train.make_train_step(model, train.language_model_loss, tx, policy, donate=False)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - t0


def kernel_summary(hlo: str) -> dict[str, int]:
    """How many calls of each library kernel the compiled step makes, by target and operand types."""
    counts: dict[str, int] = {}
    for call in library_calls(hlo):
        key = f"{call['target']}({'/'.join(call['operand_dtypes'][:2])})"
        counts[key] = counts.get(key, 0) + 1
    return counts


def trace_steps(fn, directory: Path, steps: int = 3) -> None:
    """A jax profiler trace of `steps` calls of `fn` (after one untraced call), with its Perfetto JSON."""
    jax.block_until_ready(fn())
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(fn())


def run(args) -> dict:
    size = SIZES[args.size]
    record = {"machine": machine_info(), "jax_version": jax.__version__, "size": args.size, "config": size}
    record["variants"] = {}
    fns = {}
    for variant in args.variants:
        try:
            compiled, state, batch, compile_s = build(size, variant)
        except Exception as err:  # one variant this device cannot run must not cost the others
            record["variants"][variant] = {"error": f"{type(err).__name__}: {err}"[:400]}
            print(f"{variant}: failed: {record['variants'][variant]['error']}", flush=True)
            continue
        hlo = compiled.as_text()
        fn = lambda compiled=compiled, state=state, batch=batch: compiled(state, batch)[1]["loss"]  # noqa: E731
        loss = float(fn())
        record["variants"][variant] = {"compile_s": compile_s, "first_loss": loss, "kernels": kernel_summary(hlo)}
        print(f"{variant}: compiled in {compile_s:.1f} s, loss {loss:.4f}", flush=True)
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            name = variant.replace(":", "-")
            with gzip.open(Path(args.hlo_dir) / f"{args.size}-{name}.hlo.txt.gz", "wt") as f:
                f.write(hlo)
        fns[variant] = fn
    timings = time_interleaved(fns, warmup=2, repeats=args.repeats)
    tokens = size["batch"] * size["seq_len"]
    for variant, timing in timings.items():
        record["variants"][variant].update(step_ms=timing.median * 1e3, timing=timing.as_dict())
        record["variants"][variant]["tokens_per_s"] = tokens / timing.median
    if args.trace_dir:
        for variant in args.trace:
            if variant in fns:
                trace_steps(fns[variant], Path(args.trace_dir) / f"{args.size}-{variant.replace(':', '-')}")
    return record


def table(record: dict) -> str:
    rows = [f"{'variant':14s} {'step ms':>9s} {'vs first':>9s} {'compile s':>9s}  kernels"]
    first = next((v["step_ms"] for v in record["variants"].values() if "step_ms" in v), None)
    for name, v in record["variants"].items():
        if "step_ms" not in v:
            rows.append(f"{name:14s} {'failed':>9s}  {v.get('error', '')[:100]}")
            continue
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(v["kernels"].items()))
        ratio = v["step_ms"] / first
        rows.append(f"{name:14s} {v['step_ms']:9.2f} {ratio:8.2f}x {v['compile_s']:9.1f}  {kernels[:300]}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_variants", description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="precision:attention pairs")
    parser.add_argument("--repeats", type=int, default=5)
    add_json_flags(parser, "write the record here")
    parser.add_argument("--trace-dir", default=None, help="write profiler traces of --trace variants here")
    parser.add_argument("--trace", nargs="*", default=[], help="variants to trace (default: none)")
    parser.add_argument("--hlo-dir", default=None, help="write each variant's compiled HLO (gzip) here")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    for variant in args.variants + args.trace:
        if variant.count(":") != 1:
            parser.error(f"variant {variant!r}: write it as precision:attention, e.g. bf16:auto")
    record = run(args)
    device = jax.devices()[0]
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}, GPT {args.size} {record['config']}")
    print(table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
