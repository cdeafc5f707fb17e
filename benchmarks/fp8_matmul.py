"""fp8 products against bf16, side by side: the rate of an n^3 product in bf16 and in float8 (e4m3 operands,
scaled, bf16 result) in the two forms XLA knows, and the library kernel each compiles to.

`python -m benchmarks.fp8_matmul [--sizes 4096 8192] [--json PATH]`. On a Hopper GPU XLA rewrites a scaled float8
product into a cuBLASLt fp8 GEMM; elsewhere it runs emulated (upcast, then a bf16 or f32 product), which this
script reports as such rather than as an fp8 rate.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.output import add_json_flags, refuse_existing
from experiments.common import compiled_hlo, library_calls, machine_info
from jaxnn.profile.timing import matmul_flops, time_interleaved

E4M3 = jnp.float8_e4m3fn


def _bf16(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _fp8_direct(a, b, sa, sb):
    """float8 operands into the product itself, the scales applied to its f32 result."""
    out = jax.lax.dot(a, b, preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(jnp.bfloat16)


def _fp8_dequantized(a, b, sa, sb):
    """The quantise-dequantise form (Flax's and Transformer Engine's): XLA folds the scales into the GEMM."""
    a = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    b = b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _quantize(x):
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / jnp.finfo(E4M3).max.astype(jnp.float32)
    return (x / scale).astype(E4M3), scale


def measure(n: int, repeats: int) -> dict:
    key_a, key_b = jax.random.split(jax.random.key(n))
    a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
    b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
    qa, sa = _quantize(a)
    qb, sb = _quantize(b)
    programs = {
        "bf16": (jax.jit(_bf16), (a, b)),
        "fp8 direct": (jax.jit(_fp8_direct), (qa, qb, sa, sb)),
        "fp8 dequantized": (jax.jit(_fp8_dequantized), (qa, qb, sa, sb)),
    }
    reference = _bf16(a, b).astype(jnp.float32)
    row = {"n": n, "programs": {}}
    fns = {}
    for name, (fn, args) in programs.items():
        calls = library_calls(compiled_hlo(fn, *args))
        error = jnp.linalg.norm(fn(*args).astype(jnp.float32) - reference) / jnp.linalg.norm(reference)
        row["programs"][name] = {
            "library_calls": [f"{c['target']}({'/'.join(c['operand_dtypes'])})" for c in calls],
            "f8_operands": any(d.startswith("f8") for c in calls for d in c["operand_dtypes"][:2]),
            "rel_error_vs_bf16": float(error),
        }
        fns[name] = lambda fn=fn, args=args: fn(*args)
    for name, timing in time_interleaved(fns, warmup=2, repeats=repeats).items():
        row["programs"][name]["ms"] = timing.median * 1e3
        row["programs"][name]["tflops"] = matmul_flops(n, n, n) / timing.median / 1e12
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_matmul", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=7)
    add_json_flags(parser, "also write the rows here")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    rows = [measure(n, args.repeats) for n in args.sizes]
    device = jax.devices()[0]
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}")
    print(f"{'n':>6s} {'program':16s} {'ms':>8s} {'TFLOP/s':>8s} {'rel err':>8s}  kernels")
    for row in rows:
        for name, p in row["programs"].items():
            kernels = ", ".join(p["library_calls"]) or "(no library call: XLA's own kernels)"
            figures = f"{p['ms']:8.3f} {p['tflops']:8.1f} {p['rel_error_vs_bf16']:8.4f}"
            print(f"{row['n']:6d} {name:16s} {figures}  {kernels}")
    if args.json:
        record = {"machine": machine_info(), "jax_version": jax.__version__, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
