"""`make gpu-check`: prove the run is on a GPU whose bf16 products reach the tensor cores, then run every experiment
at GPU sizes inside a fixed time budget (8 minutes on one H200), write results/<gpu-tag>/ and print a table last.

Runs from a plain checkout with the machine's own python3 (`PYTHONPATH=. python3 -m experiments.gpu_check`), so it
needs only jax, flax, optax, numpy, matplotlib and scikit-learn. `--dry-run` runs the same code path at tiny sizes
on the CPU, skipping (and saying so) the GPU assertions, so the script is known to work before GPU time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from experiments.archive import pack as pack_archive
from experiments.archive import target as archive_target
from experiments.common import params_label

# Seconds each experiment may take at GPU size, in the order they run: the claims a GPU decides first (tensor
# cores, then matrix throughput, training, inference), the CPU-side claims last. Each budget is soft (a measurement
# that starts inside it is finished). The MFU benchmark (benchmarks.train_steps.gpu_mfu, about 60-90 s) runs after
# them in a child process: an abort inside cuDNN's fused attention (reported upstream under CUDA 13) then ends
# only the child, never the experiments. With jax's start and the tensor-core check, the whole run stays inside
# TOTAL_LIMIT_S, and the child's hard timeout keeps it inside one 10-minute command.
BUDGETS = {
    "exp_precision": 40,
    "exp_matmul": 45,
    "exp_train": 70,
    "exp_inference": 45,
    "exp_sequential": 30,
    "exp_pipeline": 40,
    "exp_parallel": 25,
}
TOTAL_LIMIT_S = 430  # 8 minutes of device time, less the start of the machine and the copy of the results
OVERRUN_MARGIN_S = 40  # what one measurement that starts just inside a budget may take beyond it
MIN_EXPERIMENT_S = 15  # an experiment given less than this is skipped, not started
# The MFU child measures the bf16 step and then the fp8 policy's (about 35 s and 45 s on an H200, 2026-12-04),
# then the bf16 step on packed batches (not yet run on a GPU; about as long as the bf16 step, expected): its reserve
# plus MFU_GRACE_S covers the first two, and MFU_TIMEOUT_S all three where the parts before it kept their budgets.
MFU_RESERVE_S = 90  # kept back from the experiments for the MFU child when it will run
MFU_TIMEOUT_S = 180  # the child's hard limit: a hung compile costs at most this
# The child may end this far past TOTAL_LIMIT_S (430 + 60 s: still well inside one 10-minute command), so that
# experiments that overran still leave it a full measurement.
MFU_GRACE_S = 60
MFU_NAME = "bench_gpu_mfu"
# LoRA r=8 against full fine-tuning of a GPT-2-small-shaped model (benchmarks.lora_memory) in a child process, after
# the experiments and before the MFU child; its reserve comes out of the experiments' share.
LORA_NAME = "bench_lora"
LORA_RESERVE_S = 45
# `jaxnn serve`'s engine under load (benchmarks.serve --in-process) in a child process, after the LoRA child: four
# engines (concurrency 1, 16, 64 and one slot), each compiling its prefill and decode programs first. Not yet
# measured on a GPU: the timeout is the budget, and a run that overruns it is reported as such.
SERVE_NAME = "bench_serve"
SERVE_RESERVE_S = 45
DRY_RUN_SERVE_S = 300
# Published MFU figures (PaLM, MaxText) divide by the datasheet's dense bf16 rate, not a measured GEMM peak: the
# H200 SXM's 989 TFLOP/s (NVIDIA datasheet, dense, no sparsity). Quoted, not measured.
H200_DENSE_BF16_TFLOPS = 989.0
# A compiled program can call a bf16 GEMM and still not run on tensor cores (a library fallback): the proof is a
# measured rate. An H200's CUDA cores peak at 67 TFLOP/s fp32 (datasheet); a bf16 product measured at 3x that or
# more cannot come from them. The 4096^3 product of the check reaches several hundred TFLOP/s on tensor cores.
TENSOR_CORE_MIN_TFLOPS = 3 * 67.0
# The dry run: generous budgets so every code path runs, except exp_train's, which is spent before it starts, so
# that the skipping (decisive rows kept, the rest recorded as skipped) runs before GPU time depends on it.
DRY_RUN_BUDGETS = {**dict.fromkeys(BUDGETS, 120.0), "exp_train": 0.0}
DRY_RUN_TOTAL_S = 900.0
GEMM_TARGET = re.compile(r"cublas|cudnn|triton", re.IGNORECASE)
# Every module the run imports, checked before anything starts, so a missing one costs no GPU time.
REQUIRED_MODULES = [
    "jax",
    "numpy",
    "optax",
    "matplotlib",
    "sklearn",
    "jaxnn.layers",
    "jaxnn.models",
    "jaxnn.train",
    "jaxnn.data",
    "jaxnn.parallel",
    "jaxnn.profile.timing",
    "benchmarks.train_steps",
    *(f"experiments.{name}" for name in BUDGETS),
]


def preflight(modules: list[str] | None = None) -> list[str]:
    """Imports each module (default: REQUIRED_MODULES); returns one 'module (missing X)' entry for each that fails."""
    missing = []
    for name in REQUIRED_MODULES if modules is None else modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            culprit = getattr(err, "name", None) or str(err)
            missing.append(name if culprit == name else f"{name} (missing {culprit})")
    return missing


class CheckFailed(RuntimeError):
    pass


def tensor_core_check(n: int = 4096) -> dict:
    """Compiles a bf16 x bf16 -> f32 product and a bf16 convolution in jaxnn's own forms (`jaxnn.precision`); lists
    the library kernels in their HLO and whether each takes bf16 operands."""
    import jax
    import jax.numpy as jnp

    from experiments import common
    from jaxnn import precision
    from jaxnn.profile.timing import matmul_flops, time_fn

    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: precision.einsum("mk,kn->mn", a, b))
    x = jnp.ones((8, 32, 32, 64), jnp.bfloat16)
    w = jnp.ones((3, 3, 64, 64), jnp.bfloat16)
    conv = jax.jit(
        lambda x, w: precision.conv(
            x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )
    mm_calls = common.library_calls(common.compiled_hlo(matmul, a, a))
    # The HLO says which kernel is called; only the rate it reaches says the tensor cores ran it.
    seconds = time_fn(lambda: matmul(a, a), repeats=3).median
    tflops = matmul_flops(n, n, n) / seconds / 1e12
    conv_calls = common.library_calls(common.compiled_hlo(conv, x, w))
    gemms = [c for c in mm_calls if GEMM_TARGET.search(c["target"])]
    cudnn_convs = [c for c in conv_calls if "cudnn" in c["target"].lower()]
    return {
        "matmul_n": n,
        "matmul_calls": mm_calls,
        "conv_calls": conv_calls,
        "gemm_calls": gemms,
        "bf16_gemm": any(_bf16_operands(c) for c in gemms),
        "cudnn_conv": bool(cudnn_convs),
        # cuDNN runs a convolution on tensor cores only with half-precision inputs and filter (its first two
        # operands); f32 operands would be an f32/TF32 convolution whatever the source asked for.
        "bf16_conv": any(_bf16_operands(c) for c in cudnn_convs),
        "bf16_tflops": tflops,
        "tensor_core_min_tflops": TENSOR_CORE_MIN_TFLOPS,
        "tensor_core_rate": tflops >= TENSOR_CORE_MIN_TFLOPS,
    }


def _bf16_operands(call: dict) -> bool:
    dtypes = call["operand_dtypes"][:2]
    return len(dtypes) == 2 and all(d == "bf16" for d in dtypes)


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
    from experiments import (
        exp_inference,
        exp_matmul,
        exp_parallel,
        exp_pipeline,
        exp_precision,
        exp_sequential,
        exp_train,
    )

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
    from jaxnn.profile.timing import time_interleaved

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


class Progress:
    """gpu_check.json, rewritten (atomically) as each part of the run ends: a crash or the time limit keeps every
    finished part, and `complete` says whether the run got to its end."""

    def __init__(self, path: Path, record: dict, archive: Path | None = None):
        self.path, self.record = path, {**record, "table": [], "complete": False}
        self.archive = archive

    def add(self, name: str, status: str, seconds: float, line: str) -> None:
        self.record["table"].append({"name": name, "status": status, "seconds": seconds, "headline": line})
        print(f"gpu-check: {name} {status} in {seconds:.0f} s", flush=True)
        self.save()
        self.pack()

    def pack(self) -> None:
        """Refreshes the archive (when asked for one): what a time limit leaves must already be packed."""
        if self.archive is None:
            return
        try:
            pack_archive(self.path.parent, self.archive)
        except OSError as err:  # a full disk costs the archive, never the measurements
            print(f"gpu-check: could not write {self.archive}: {err}", file=sys.stderr)

    def save(self, **fields) -> None:
        self.record.update(fields)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        os.replace(tmp, self.path)

    def failed(self) -> bool:
        return any(row["status"] == "FAILED" for row in self.record["table"])


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__)
    parser.add_argument("--out", default="results", help="results folder (results/<gpu-tag>/ is written)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes on the CPU, GPU assertions skipped: proves the script before GPU time",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=[*BUDGETS, MFU_NAME, LORA_NAME, SERVE_NAME],
        help=f"run only these experiments ({MFU_NAME}, {LORA_NAME}, {SERVE_NAME}: the benchmarks, which --only "
        "otherwise skips)",
    )
    parser.add_argument("--no-mfu", action="store_true", help="skip the MFU benchmark (its child process)")
    parser.add_argument(
        "--archive",
        default=None,
        metavar="PATH",
        help="also write the results folder as one tar.gz (a folder, or a name ending in /, gets <tag>.tar.gz "
        "and copies of gpu_check.json and gpu_mfu.json), refreshed as each part ends",
    )
    parser.add_argument("--total-limit", type=float, default=None, help="seconds for the whole run (default 430)")
    parser.add_argument(
        "--budget", action="append", default=[], metavar="NAME=SECONDS", help="one experiment's budget (repeatable)"
    )
    args = parser.parse_args(argv)
    args.budgets = dict(DRY_RUN_BUDGETS if args.dry_run else BUDGETS)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in BUDGETS:
            parser.error(f"--budget {item!r}: unknown experiment {name!r}; choose from {', '.join(BUDGETS)}")
        try:
            args.budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--budget {item!r}: seconds must be a number")
    if args.total_limit is None:
        args.total_limit = DRY_RUN_TOTAL_S if args.dry_run else TOTAL_LIMIT_S
    args.mfu = not args.no_mfu and (args.only is None or MFU_NAME in args.only)
    args.lora = args.only is None or LORA_NAME in args.only
    args.serve = args.only is None or SERVE_NAME in args.only
    try:
        archive_target(args.archive, "tag")
    except ValueError as err:
        parser.error(str(err))
    return args


def run_child(cmd: list[str], timeout_s: float) -> str:
    """Runs a benchmark module in a child process with a hard timeout (a crash, an abort or a hang there costs the
    run that measurement only); returns how it ended."""
    # The parent keeps its GPU memory; without preallocation the child takes only what it needs of the rest.
    root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONPATH": pythonpath}
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, check=False)
        return f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        return f"killed after its {timeout_s:.0f} s timeout"


def run_mfu(out_dir: Path, dry_run: bool, timeout_s: float, progress: Progress) -> dict | None:
    """make bench-gpu (the MFU target) in a child process with a hard timeout: a crash, an abort or a hang there
    costs the run that measurement only. Returns what the child wrote to gpu_mfu.json (also a partial file)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks.train_steps", "--gpu", "--out-dir", str(out_dir)]
    path = out_dir / "gpu_mfu.json"
    path.unlink(missing_ok=True)  # a stale file from an earlier run must not pass as this run's
    ended = run_child([*cmd, *(["--dry-run"] if dry_run else [])], timeout_s)
    try:
        mfu = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        mfu = None
    if mfu is not None and mfu.get("model_tflops"):
        mfu["mfu_datasheet"] = mfu["model_tflops"] / H200_DENSE_BF16_TFLOPS
        mfu["datasheet_tflops"] = H200_DENSE_BF16_TFLOPS
    ok = mfu is not None and mfu.get("mfu") is not None
    progress.save(mfu=mfu)
    progress.add(MFU_NAME, "ok" if ok else "FAILED", time.perf_counter() - t0, mfu_headline(mfu, ended))
    return mfu


def run_lora(out_dir: Path, dry_run: bool, timeout_s: float, progress: Progress) -> dict | None:
    """benchmarks.lora_memory (full fine-tuning against LoRA r=8, GPT-2 small shape, fp32 AdamW) in a child process
    with a hard timeout, like the MFU child; returns its lora_memory.json."""
    t0 = time.perf_counter()
    path = out_dir / "lora_memory.json"
    path.unlink(missing_ok=True)
    size = ["--models", "tiny", "--batch", "2", "--seq-len", "16", "--steps", "1"] if dry_run else [
        "--models", "gpt2-small", "--batch", "8", "--seq-len", "512", "--steps", "5"]  # fmt: skip
    # The int8 and nf4 bases' rows where Qwix is installed (the GPU machine has no network: it may lack it).
    bases = ["int8", "nf4"] if importlib.util.find_spec("qwix") else []
    cmd = [sys.executable, "-m", "benchmarks.lora_memory", "--ranks", "8", "--bases", *bases, "--json", str(path)]
    ended = run_child(cmd + size, timeout_s)
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, json.JSONDecodeError, KeyError):
        rows = None
    progress.save(lora=rows)
    if not rows or len(rows) < 2:
        progress.add(LORA_NAME, "FAILED", time.perf_counter() - t0, f"no LoRA measurement ({ended})")
        return None
    full, adapted = rows[0], rows[1]
    progress.add(
        LORA_NAME,
        "ok",
        time.perf_counter() - t0,
        f"{full['model']} LoRA r=8 vs full: {adapted['step_ms']:.1f} vs {full['step_ms']:.1f} ms/step, peak "
        f"{adapted['peak_bytes'] / 2**30:.2f} vs {full['peak_bytes'] / 2**30:.2f} GiB, optimizer state "
        f"{100 * adapted['opt_state_bytes'] / full['opt_state_bytes']:.2f}% of full",
    )
    return {"rows": rows}


def run_serve(out_dir: Path, dry_run: bool, timeout_s: float, progress: Progress) -> dict | None:
    """benchmarks.serve on the engine in process (no HTTP: the GPU machine has no server stack), GPT-2 small,
    64-token prompts and 64 new tokens, at concurrency 1, 16 and 64 and one request at a time, in a child process
    with a hard timeout; returns its rows."""
    t0 = time.perf_counter()
    path = out_dir / "serve.json"
    path.unlink(missing_ok=True)
    size = ["--size", "small", "--concurrency", "1", "4", "--prompt", "8", "--new-tokens", "8"] if dry_run else [
        "--size", "gpt2-small", "--concurrency", "1", "16", "64"]  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.serve", "--in-process", "--no-transformers", "--json", str(path)]
    ended = run_child(cmd + size, timeout_s)
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, json.JSONDecodeError, KeyError):
        rows = None
    progress.save(serve=rows)
    if not rows:
        progress.add(SERVE_NAME, "FAILED", time.perf_counter() - t0, f"no serving measurement ({ended})")
        return None
    batched = {r["concurrency"]: r["tokens_per_s"] for r in rows if "--slots" not in r["server"]}
    alone = next((r for r in rows if "--slots" in r["server"]), None)
    line = "tokens/s by concurrency: " + ", ".join(f"{c}: {v:.0f}" for c, v in batched.items())
    if alone is not None and alone["concurrency"] in batched:
        gain = batched[alone["concurrency"]] / alone["tokens_per_s"]
        line += f"; {gain:.1f}x one at a time at {alone['concurrency']}"
    progress.add(SERVE_NAME, "ok", time.perf_counter() - t0, line)
    return {"rows": rows}


def mfu_headline(mfu: dict | None, ended: str) -> str:
    """MFU against both denominators: the bf16 GEMM peak of the same run and the datasheet's dense bf16 rate."""
    if not mfu or mfu.get("mfu") is None:
        notes = "; ".join((mfu or {}).get("notes", []))
        return f"no MFU ({ended}){': ' + notes if notes else ''}"[:200]
    return (
        f"GPT {params_label(mfu.get('num_params', 0))} bf16 attention {mfu.get('attention')}: "
        f"{mfu['step_s'] * 1e3:.1f} ms/step, MFU {100 * mfu['mfu']:.1f}% of the run's "
        f"{mfu['peak']['gflops'] / 1e3:.3g} TFLOP/s bf16 GEMM peak, {100 * mfu['mfu_datasheet']:.1f}% of the "
        f"datasheet's {H200_DENSE_BF16_TFLOPS:.0f} TFLOP/s dense bf16{_fp8_clause(mfu.get('fp8'))}"
        f"{_packed_clause(mfu.get('packed'))}{_kinds_clause(mfu.get('kernels'))}"
    )


def _kinds_clause(kernels: dict | None) -> str:
    """Where the bf16 step's device time went, by kind of operation (jaxnn.profile.kernel_table)."""
    if not kernels or "by_kind" not in kernels:
        return f"; no kernel table: {kernels['error'][:80]}" if kernels and "error" in kernels else ""
    return "; device time " + " ".join(f"{k} {100 * v:.0f}%" for k, v in list(kernels["by_kind"].items())[:4])


def _packed_clause(packed: dict | None) -> str:
    """The bf16 step on packed batches against the unpacked one, as the MFU child measured it."""
    if not packed:
        return ""
    if "step_s" not in packed:
        return f"; packed failed: {packed.get('error', '?')[:80]}"
    return f"; packed {packed['step_s'] * 1e3:.1f} ms/step ({packed['mfu_over_unpacked']:.2f}x the unpacked MFU)"


def _fp8_clause(fp8: dict | None) -> str:
    """The fp8 policy's step (benchmarks.train_steps.FP8_POLICY) against bf16's, as the MFU child measured it."""
    if not fp8:
        return ""
    if "step_s" not in fp8:
        return f"; fp8 failed: {fp8.get('error', '?')[:80]}"
    return (
        f"; {fp8.get('policy', 'fp8')} {fp8['step_s'] * 1e3:.1f} ms/step "
        f"({fp8['speedup_over_bf16']:.2f}x bf16's speed, {fp8['float8_gemm_calls']} fp8 GEMMs)"
    )


def run_experiments(args, size: str, start: float, progress: Progress) -> None:
    from experiments import common

    reserve = (MFU_RESERVE_S if args.mfu else 0.0) + (LORA_RESERVE_S if args.lora else 0.0)
    reserve += SERVE_RESERVE_S if args.serve else 0.0
    reserve = 0.0 if args.dry_run else reserve
    for name, budget in args.budgets.items():
        if args.only is not None and name not in args.only:
            continue
        # An experiment's budget shrinks to what the whole run has left, less a margin for the measurement that
        # overruns a soft budget and the MFU child's share, so the last experiment cannot push the run past its
        # ceiling.
        left = args.total_limit - OVERRUN_MARGIN_S - reserve - (time.perf_counter() - start)
        if left < MIN_EXPERIMENT_S:
            progress.add(name, "skipped", 0.0, f"out of total time ({left:.0f} s left)")
            continue
        module = importlib.import_module(f"experiments.{name}")
        t0 = time.perf_counter()
        try:
            _, record = common.run_and_save(name, module.run, module.plot, size, args.out, min(budget, left))
            status = "ok" if not record.get("skipped") else f"ok, {len(record['skipped'])} skipped"
            progress.add(name, status, time.perf_counter() - t0, headline(name, record))
        except Exception as err:  # one failing experiment must not cost the others their GPU time
            traceback.print_exc()
            progress.add(name, "FAILED", time.perf_counter() - t0, f"{type(err).__name__}: {err}"[:100])


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    # Before jax starts: without preallocation (75% of the GPU by default) this process holds only what its
    # experiments used, and the MFU child started after them finds the rest free.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    missing = preflight()
    if missing:
        print(f"gpu-check: cannot start, missing modules: {', '.join(missing)}", file=sys.stderr)
        return 2
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
    from experiments import common

    out_dir = common.results_path(args.out, "gpu_check", common.machine_tag()).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    size = "tiny" if args.dry_run else "gpu"
    progress = Progress(
        out_dir / "gpu_check.json",
        {"name": "gpu_check", "machine": common.machine_info()},
        archive=archive_target(args.archive, out_dir.name),
    )
    progress.save(
        size=size,
        dry_run=args.dry_run,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        check=info,
        budgets_s=args.budgets,
        total_limit_s=args.total_limit,
    )
    report_check(info, args.dry_run, progress)
    try:
        lowerings = lowering_ab(args.dry_run)
        print(
            "gpu-check: gradient ms by lowering: " + ", ".join(f"{k} {v:.2f}" for k, v in lowerings["grad_ms"].items())
        )
    except Exception as err:  # a side measurement; it must not cost the experiments their GPU time
        traceback.print_exc()
        lowerings = {"error": f"{type(err).__name__}: {err}"[:300]}
    progress.save(lowerings=lowerings)
    run_experiments(args, size, start, progress)
    if args.lora:
        run_lora(out_dir, args.dry_run, LORA_RESERVE_S, progress)
    if args.serve:
        # A CPU compiles the dry run's four engines' programs slower than a GPU runs the real ones.
        run_serve(out_dir, args.dry_run, DRY_RUN_SERVE_S if args.dry_run else SERVE_RESERVE_S, progress)
    if args.mfu:
        left = args.total_limit + MFU_GRACE_S - (time.perf_counter() - start)
        run_mfu(out_dir, args.dry_run, min(MFU_TIMEOUT_S, max(left, MIN_EXPERIMENT_S)), progress)
    total = time.perf_counter() - start
    progress.save(total_s=total, complete=True)
    progress.pack()
    print(f"\n{'experiment':16s} {'status':16s} {'seconds':>7s}  headline")
    for row in progress.record["table"]:
        print(f"{row['name']:16s} {row['status']:16s} {row['seconds']:7.1f}  {row['headline']}")
    print(f"{'total':16s} {'':16s} {total:7.1f}  results in {out_dir}")
    return 1 if progress.failed() else 0


def report_check(info: dict, dry_run: bool, progress: Progress) -> None:
    """Prints what the tensor-core check found; a convolution that would not run on tensor cores is a failed row
    (the run goes on: its other figures are still worth the GPU time)."""
    gemm = ", ".join(sorted({f"{c['target']}({'/'.join(c['operand_dtypes'])})" for c in info["gemm_calls"]}))
    conv = ", ".join(sorted({f"{c['target']}({'/'.join(c['operand_dtypes'])})" for c in info["conv_calls"]}))
    print(
        f"gpu-check: {info['device_kind']} ({info['backend']}), jax {info['jax_version']}; bf16 GEMM: "
        f"{gemm or 'none'} at {info['bf16_tflops']:.3g} TFLOP/s; convolution: {conv or 'none'}",
        flush=True,
    )
    if not dry_run and not info["tensor_core_rate"]:
        progress.add(
            "tensor_core_rate",
            "FAILED",
            0.0,
            f"bf16 {info['matmul_n']}^3 product at {info['bf16_tflops']:.0f} TFLOP/s, under the "
            f"{TENSOR_CORE_MIN_TFLOPS:.0f} TFLOP/s no CUDA core reaches: tensor cores did not run it",
        )
    if not dry_run and not info["bf16_conv"]:
        progress.add(
            "tensor_core_conv", "FAILED", 0.0, f"the bf16 convolution is not a cuDNN call on bf16 operands: {conv}"
        )


if __name__ == "__main__":
    sys.exit(main())
