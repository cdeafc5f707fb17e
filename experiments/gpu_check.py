"""`make gpu-check`: prove the run is on a GPU whose bf16 products reach the tensor cores, then run every experiment
at GPU sizes inside a fixed time budget (8 minutes on one H200), write results/<gpu-tag>/ and print a table last.

Runs from a plain checkout with the machine's own python3 (`PYTHONPATH=. python3 -m experiments.gpu_check`), so it
needs only jax, flax, optax, numpy, matplotlib and scikit-learn. `--dry-run` runs the same code path at tiny sizes
on the CPU, skipping (and saying so) the GPU assertions, so the script is known to work before GPU time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import traceback

from experiments import (
    common,
    exp_inference,
    exp_matmul,
    exp_parallel,
    exp_pipeline,
    exp_precision,
    exp_sequential,
    exp_train,
)
from experiments.run_all import BUDGETS as RUN_BUDGETS

# Seconds each experiment may take at GPU size (run_all.BUDGETS["gpu"]: one table for both entry points). Their sum
# stays well under the 8 minutes because each budget is soft (a measurement that starts inside the budget is
# finished) and jax's start, the tensor-core check and the plots come on top.
BUDGETS = RUN_BUDGETS["gpu"]  # the MFU benchmark (benchmarks.train_steps.gpu_mfu) runs first, outside these
TOTAL_LIMIT_S = 460  # 8 minutes less jax's start on the GPU and the final writing
OVERRUN_MARGIN_S = 40
EXPERIMENTS = [exp_matmul, exp_precision, exp_sequential, exp_pipeline, exp_inference, exp_parallel, exp_train]
GEMM_TARGET = re.compile(r"cublas|cudnn|triton", re.IGNORECASE)


class CheckFailed(RuntimeError):
    pass


def tensor_core_check(n: int = 4096) -> dict:
    """Compiles a bf16 x bf16 -> f32 product and a bf16 convolution; lists the library kernels in their HLO."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    x = jnp.ones((8, 32, 32, 64), jnp.bfloat16)
    w = jnp.ones((3, 3, 64, 64), jnp.bfloat16)
    conv = jax.jit(
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32
        )
    )
    mm_calls = common.library_calls(common.compiled_hlo(matmul, a, a))
    conv_calls = common.library_calls(common.compiled_hlo(conv, x, w))
    gemms = [c for c in mm_calls if GEMM_TARGET.search(c["target"])]
    bf16_gemms = [c for c in gemms if c["operand_dtypes"] and all(d == "bf16" for d in c["operand_dtypes"])]
    return {
        "matmul_n": n,
        "matmul_calls": mm_calls,
        "conv_calls": conv_calls,
        "gemm_calls": gemms,
        "bf16_gemm": bool(bf16_gemms),
        "cudnn_conv": any("cudnn" in c["target"].lower() for c in conv_calls),
    }


def check_gpu(dry_run: bool) -> dict:
    """Stops with a one-line reason unless jax runs on a GPU and a bf16 product is a library GEMM on bf16 operands."""
    import jax

    backend = jax.default_backend()
    device = jax.devices()[0]
    info = {"backend": backend, "device_kind": device.device_kind, "jax_version": jax.__version__, "dry_run": dry_run}
    if not dry_run and backend != "gpu":
        raise CheckFailed(
            f"gpu-check: jax runs on '{backend}' ({device.device_kind}), not a GPU; is the CUDA "
            "plugin installed (jax-cuda13-plugin) and a GPU visible (nvidia-smi)?"
        )
    hlo = tensor_core_check(64 if dry_run else 4096)
    info.update(hlo)
    if not dry_run and not hlo["bf16_gemm"]:
        found = ", ".join(f"{c['target']}({'/'.join(c['operand_dtypes'])})" for c in hlo["matmul_calls"]) or "none"
        raise CheckFailed(
            "gpu-check: the bf16 product did not lower to a cuBLAS/cuDNN/Triton GEMM with bf16 "
            f"operands (library calls found: {found}); tensor cores would not be used"
        )
    return info


def headline(name: str, record: dict) -> str:
    """One short line of the figures that matter most, for the final table."""
    try:
        if name == "exp_matmul":
            s = exp_matmul.summary(record)
            best = {k: f"{v[0]:.0f}" for k, v in s["best_gflops"].items()}
            return "best GFLOP/s " + " ".join(f"{k}={v}" for k, v in best.items())
        if name == "exp_precision":
            s = exp_precision.summary(record).get("matmul", {})
            return " ".join(f"{m}={v['speedup']:.1f}x" for m, v in s.items() if v.get("speedup")) + " vs fp32"
        if name == "exp_sequential":
            s = exp_sequential.summary(record)["per_step_us"]
            return " ".join(f"{b}:{min(v['chain'].values()):.1f}us/step" for b, v in s.items() if "chain" in v)
        if name == "exp_pipeline":
            s = exp_pipeline.summary(record)
            top = max(s) if s else None
            return f"cost {top}: best {s[top]['best']} ({s[top].get('best_over_sync', 0):.2f}x sync)" if s else ""
        if name == "exp_inference":
            s = exp_inference.summary(record)
            return " ".join(
                f"{b}/{m}: p50@1={v.get('batch1_p50_ms', float('nan')):.2f}ms max={v['best_samples_per_s']:.0f}/s"
                for b, per in s.items()
                for m, v in per.items()
            )
        if name == "exp_parallel":
            g = exp_parallel.summary(record).get("batch_gain")
            return f"batch {g['from']}->{g['to']}: x{g['gain']:.1f} samples/s" if g else ""
        if name == "exp_train":
            s = exp_train.summary(record)
            return " ".join(
                f"{m}/{p}={v['speedup']:.1f}x"
                for m, per in s.items()
                for p, v in per.items()
                if p != "fp32" and v.get("speedup")
            )
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as err:
        return f"(no headline: {err})"
    return ""


def lowering_ab(dry_run: bool) -> dict:
    """Gradient time of each Conv and MaxPool lowering on this device, side by side: the data that decides what
    `lowering="auto"` should pick on GPUs (measured so far on the CPU only; docs/performance.md)."""
    import jax
    import jax.numpy as jnp

    from jaxnn import layers as L
    from jaxnn.timing import time_interleaved

    batch, hw, channels = (4, 8, 8) if dry_run else (256, 32, 64)
    x = jax.random.normal(jax.random.key(0), (batch, hw, hw, channels), jnp.bfloat16 if not dry_run else jnp.float32)
    fns = {}
    candidates = {
        "conv": {low: L.Conv(channels, 3, padding="SAME", lowering=low) for low in ("xla", "im2col")},
        "max_pool": {low: L.MaxPool(2, lowering=low) for low in ("reduce_window", "reshape")},
    }
    for kind, layers in candidates.items():
        for lowering, layer in layers.items():
            _, params = layer.init(jax.random.key(1), x.shape)
            params = jax.tree.map(lambda p: p.astype(x.dtype), params)
            grad = jax.jit(
                jax.grad(lambda p, x, layer=layer: jnp.sum(layer.apply(p, x).astype(jnp.float32) ** 2), argnums=(0, 1))
            )
            fns[f"{kind} {lowering}"] = lambda grad=grad, params=params: grad(params, x)
    timings = time_interleaved(fns, warmup=2, repeats=3 if dry_run else 7)
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "grad_ms": {name: t.median * 1e3 for name, t in timings.items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__)
    parser.add_argument("--out", default="results", help="results folder (results/<gpu-tag>/ is written)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes on the CPU, GPU assertions skipped: proves the script before GPU time",
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these experiments (names)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.dry_run:
        # Two simulated CPU devices, so exp_parallel exercises the sharded path; must precede jax's start.
        from jaxnn.parallel import configure_cpu_devices

        # If jax already started (e.g. inside the test suite), use the devices it has.
        with contextlib.suppress(RuntimeError):
            configure_cpu_devices(2)
        print("gpu-check: DRY RUN on the CPU at tiny sizes; the GPU and tensor-core assertions are skipped")
    try:
        info = check_gpu(args.dry_run)
    except CheckFailed as err:
        print(err, file=sys.stderr)
        return 2
    tag = common.machine_tag()
    out_dir = common.results_path(args.out, "gpu_check", tag).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    gemm = ", ".join(sorted({f"{c['target']}({'/'.join(c['operand_dtypes'])})" for c in info["gemm_calls"]}))
    print(
        f"gpu-check: {info['device_kind']} ({info['backend']}), jax {info['jax_version']}; bf16 GEMM: "
        f"{gemm or 'none'}; cuDNN convolution: {info['cudnn_conv']}"
    )
    size = "tiny" if args.dry_run else "gpu"
    try:
        lowerings = lowering_ab(args.dry_run)
        print(
            "gpu-check: gradient ms by lowering: "
            + ", ".join(f"{name} {ms:.2f}" for name, ms in lowerings["grad_ms"].items()),
            flush=True,
        )
    except Exception as err:  # a side measurement; it must not cost the experiments their GPU time
        traceback.print_exc()
        lowerings = {"error": f"{type(err).__name__}: {err}"[:300]}
    table = []
    # make bench-gpu (the MFU target) first: it is one measurement that cannot be cut short, so it runs while
    # the whole budget is there, and the experiments' soft budgets shrink to what it leaves.
    t0 = time.perf_counter()
    try:
        from benchmarks.train_steps import gpu_mfu

        mfu = gpu_mfu(str(out_dir), dry_run=args.dry_run)
        status = "ok" if mfu.get("mfu") is not None else "FAILED"
        line = (
            f"GPT {mfu.get('num_params', 0) / 1e6:.3g}M bf16 attention {mfu.get('attention')}: "
            f"{mfu.get('step_s', float('nan')) * 1e3:.1f} ms/step, MFU "
            + ("-" if mfu.get("mfu") is None else f"{100 * mfu['mfu']:.1f}%")
            + f" of a {mfu['peak']['gflops'] / 1e3:.3g} TFLOP/s bf16 GEMM peak"
        )
    except Exception as err:  # one failing measurement must not cost the experiments their GPU time
        traceback.print_exc()
        status, line = "FAILED", f"{type(err).__name__}: {err}"[:100]
    table.append(("bench_gpu_mfu", status, time.perf_counter() - t0, line))
    print(f"gpu-check: bench_gpu_mfu {status} in {table[-1][2]:.0f} s", flush=True)
    for module in EXPERIMENTS:
        name = module.NAME
        if args.only is not None and name not in args.only:
            continue
        # An experiment's budget shrinks to what the whole run has left, less a margin for the measurement that
        # overruns a soft budget, so the last experiment cannot push the run past its ceiling.
        left = TOTAL_LIMIT_S - OVERRUN_MARGIN_S - (time.perf_counter() - start)
        if not args.dry_run and left < 15:
            table.append((name, "skipped", 0.0, "out of total time"))
            continue
        budget_s = min(BUDGETS[name], left) if not args.dry_run else None
        t0 = time.perf_counter()
        try:
            path, record = common.run_and_save(name, module.run, module.plot, size, args.out, budget_s)
            status = "ok" if not record.get("skipped") else f"ok, {len(record['skipped'])} skipped"
            table.append((name, status, time.perf_counter() - t0, headline(name, record)))
        except Exception as err:  # one failing experiment must not cost the others their GPU time
            traceback.print_exc()
            table.append((name, "FAILED", time.perf_counter() - t0, f"{type(err).__name__}: {err}"[:100]))
        print(f"gpu-check: {name} {table[-1][1]} in {table[-1][2]:.0f} s", flush=True)
    total = time.perf_counter() - start
    record = {
        "name": "gpu_check",
        "machine": common.machine_info(),
        "size": size,
        "dry_run": args.dry_run,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "check": info,
        "lowerings": lowerings,
        "total_s": total,
        "budgets_s": BUDGETS,
        "table": [dict(zip(("name", "status", "seconds", "headline"), row)) for row in table],
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{'experiment':16s} {'status':16s} {'seconds':>7s}  headline")
    for name, status, seconds, line in table:
        print(f"{name:16s} {status:16s} {seconds:7.1f}  {line}")
    print(f"{'total':16s} {'':16s} {total:7.1f}  results in {out_dir}")
    return 1 if any(row[1] == "FAILED" for row in table) else 0


if __name__ == "__main__":
    sys.exit(main())
