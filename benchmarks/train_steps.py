"""Training-step time of the benchmark models in fp32 and bf16 (`make bench`), and GPU MFU (`make bench-gpu`).

The GPU check trains a ~300M-parameter GPT in bf16 against the bf16 GEMM peak measured in the same run.
"""

# `python -m benchmarks.train_steps` times the four benchmark models (SPECS) as a plain jitted step and as K steps
# per call (lax.scan); `--gpu` runs the GPU check (`gpu_mfu`). The peers in benchmarks/peers build the same models
# from SPECS and time them with the same `jaxnn.profile.timing.time_fn`, so every library is measured alike.

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, params_label, refuse_existing
from experiments.peaks import Ceiling, ceiling
from jaxnn.profile.timing import flops_of, measure_matmul_peak, stepper, time_fn

# The benchmark models, shared with the peers in benchmarks/peers so that every library builds the same network.
# `scan_k` is how many steps one call of the scan variant runs: enough to amortise dispatch for the small models,
# few for the large ones, where dispatch is already negligible and a call would otherwise take seconds.
SPECS: dict[str, dict] = {
    "tiny": {"kind": "mlp", "batch": 32, "in_features": 16, "hidden": (32,), "classes": 10, "scan_k": 32},
    "mlp": {"kind": "mlp", "batch": 256, "in_features": 784, "hidden": (512, 512), "classes": 10, "scan_k": 8},
    "cnn": {"kind": "cnn", "batch": 64, "image": (32, 32, 3), "widths": (32, 64, 128), "classes": 10, "scan_k": 4},
    "gpt": {
        "kind": "gpt",
        "batch": 16,
        "seq_len": 128,
        "d_model": 256,
        "num_layers": 4,
        "num_heads": 4,
        "vocab": 256,
        "scan_k": 2,
    },
}
PRECISIONS = ("fp32", "bf16")
LEARNING_RATE = 1e-3


def synthetic_batch(name: str, seed: int = 0) -> dict:
    """A fixed random batch for model `name` as numpy arrays (`x`, `y`), identical for jaxnn and every peer."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    if spec["kind"] == "gpt":
        tokens = rng.integers(0, spec["vocab"], (spec["batch"], spec["seq_len"] + 1), dtype=np.int32)
        return {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    shape = (spec["batch"], spec["in_features"]) if spec["kind"] == "mlp" else (spec["batch"], *spec["image"])
    return {
        "x": rng.standard_normal(shape, dtype=np.float32),
        "y": rng.integers(0, spec["classes"], (spec["batch"],), dtype=np.int32),
    }


def jaxnn_model(name: str, **gpt_overrides):
    """The jaxnn layer and loss function for benchmark model `name` (`gpt_overrides`: GPTConfig fields)."""
    from jaxnn import models, train

    spec = SPECS[name]
    if spec["kind"] == "mlp":
        return models.MLP(
            models.MLPConfig(hidden=spec["hidden"], num_classes=spec["classes"])
        ), train.classification_loss
    if spec["kind"] == "cnn":
        return models.CNN(
            models.CNNConfig(widths=spec["widths"], num_classes=spec["classes"])
        ), train.classification_loss
    return models.GPT(gpt_config(spec, **gpt_overrides)), train.language_model_loss


def gpt_config(spec: dict, **overrides):
    """The GPTConfig of a benchmark spec (SPECS' and GPU_GPT's keys), with `overrides` for other fields."""
    from jaxnn import models

    sizes = {name: spec[name] for name in ("seq_len", "d_model", "num_layers", "num_heads")}
    return models.GPTConfig(vocab_size=spec["vocab"], **sizes, **overrides)


def bench_jaxnn(name: str, precision: str, *, scan: bool = True, repeats: int = 7) -> dict:
    """One benchmark row: jaxnn's plain jitted step and K-steps scan step for model `name` at `precision`.

    Returns milliseconds per step (median and spread) for both, and the compiled FLOPs of one step.
    """
    import optax

    from jaxnn import train

    model, loss_fn = jaxnn_model(name)
    tx = optax.adam(LEARNING_RATE)
    batch = jax.tree.map(jnp.asarray, synthetic_batch(name))
    in_shape = batch["x"].shape
    state = train.create_train_state(model, tx, jax.random.key(0), in_shape, precision)
    step = train.make_train_step(model, loss_fn, tx, precision)
    # Cold compile times: benchmarks never enable the persistent compilation cache.
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = {"trace_lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
    flops = flops_of(compiled)
    timing = time_fn(stepper(compiled, state, batch), repeats=repeats)
    row = {
        "library": "jaxnn",
        "model": name,
        "precision": precision,
        "step_ms": timing.median * 1e3,
        "timing": timing.as_dict(),
        "flops_per_step": flops,
        **compile_s,
    }
    if scan:
        k = SPECS[name]["scan_k"]
        batches = jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), batch)
        multi = train.make_multi_step(model, loss_fn, tx, precision)
        state = train.create_train_state(model, tx, jax.random.key(0), in_shape, precision)
        multi = multi.lower(state, batches).compile()
        scan_timing = time_fn(stepper(multi, state, batches), repeats=repeats)
        row.update(scan_k=k, scan_step_ms=scan_timing.median / k * 1e3, scan_timing=scan_timing.as_dict())
    return row


def _peaks(quick: bool) -> dict:
    size = 2048  # the size the experiments' and the profiler's CPU peaks use, quick or not: one peak per machine
    return {p: measure_matmul_peak(size, jnp.float32 if p == "fp32" else jnp.bfloat16) for p in PRECISIONS}


def run_benchmarks(
    models=tuple(SPECS),
    precisions=PRECISIONS,
    *,
    quick: bool = False,
    scan: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Runs `make bench`: the matmul peaks first, then every (model, precision) row, each with GFLOP/s and the
    fraction of the peak of its own compute dtype (the f32 GEMM for fp32, bf16 x bf16 -> f32 for bf16)."""
    repeats = 3 if quick else 7
    peaks = _peaks(quick)
    rows = []
    for name in models:
        for precision in precisions:
            try:
                row = bench_jaxnn(name, precision, scan=scan, repeats=repeats)
            except Exception as err:  # one failing configuration must not hide the other rows' figures
                row = {
                    "library": "jaxnn",
                    "model": name,
                    "precision": precision,
                    "step_ms": None,
                    "flops_per_step": None,
                    "error": f"{type(err).__name__}: {err}"[:300],
                }
                rows.append(row)
                if progress:
                    progress(f"{name} {precision}: FAILED {row['error']}")
                continue
            if row["flops_per_step"]:
                best_ms = min(row["step_ms"], row.get("scan_step_ms", row["step_ms"]))
                row["gflops"] = row["flops_per_step"] / (best_ms * 1e-3) / 1e9
            rows.append(row)
            if progress:
                progress(
                    f"{name} {precision}: {row['step_ms']:.4g} ms/step"
                    + (f", scan {row['scan_step_ms']:.4g} ms/step" if "scan_step_ms" in row else "")
                )
    tops = _ceilings(peaks, rows)
    for row in rows:
        if row.get("gflops"):
            row["fraction_of_peak"] = row["gflops"] / tops[row["precision"]].gflops
    return {
        "device": str(jax.devices()[0]),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_label(),
        "peaks": peaks,
        "ceilings": {p: {"gflops": c.gflops, "note": c.note} for p, c in tops.items()},
        "rows": rows,
    }


def _ceilings(peaks: dict, rows: list[dict]) -> dict[str, Ceiling]:
    """Per precision, what "of peak" divides by: its GEMM peak, or a faster step of the same run (a step's products
    can outrun the one 2048^3 GEMM the peak times), so that no row reads above 100%."""
    out = {}
    for precision, peak in peaks.items():
        rates = [(f"the {r['model']} step", r.get("gflops")) for r in rows if r["precision"] == precision]
        out[precision] = ceiling(peak["gflops"], rates)
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_report(result: dict) -> str:
    """The `make bench` table as text."""
    peaks = result["peaks"]
    lines = [
        f"device {result['device']} ({result.get('cpu', 'CPU not recorded')}; jax {result['jax']}); large-GEMM peak: "
        + ", ".join(f"{p} {v['gflops']:.0f} GFLOP/s ({v['size']}^3)" for p, v in peaks.items()),
        f"{'model':6} {'prec':5} {'jit ms/step':>12} {'scan ms/step':>13} {'K':>3} {'scan/jit':>8} "
        f"{'GFLOP/step':>10} {'GFLOP/s':>8} {'of peak':>8} {'trace s':>7} {'compile s':>9}",
    ]
    for r in result["rows"]:
        scan_ms, flops, gflops, frac = (
            r.get("scan_step_ms"),
            r.get("flops_per_step"),
            r.get("gflops"),
            r.get("fraction_of_peak"),
        )
        if r.get("error"):
            lines.append(f"{r['model']:6} {r['precision']:5} failed: {r['error']}")
            continue
        lines.append(
            f"{r['model']:6} {r['precision']:5} {r['step_ms']:12.4g} {_fmt(scan_ms, '.4g'):>13} "
            f"{r.get('scan_k', '-'):>3} {_fmt(scan_ms and scan_ms / r['step_ms'], '.2f'):>8} "
            f"{_fmt(flops and flops / 1e9, '.3g'):>10} {_fmt(gflops, '.1f'):>8} "
            f"{_fmt(frac and 100 * frac, '.0f', '%'):>8} {_fmt(r.get('trace_lower_s'), '.2f'):>7} "
            f"{_fmt(r.get('compile_s'), '.2f'):>9}"
        )
    lines.append("GFLOP/s uses the faster of the two variants; 'of peak' is against the GEMM peak of the row's dtype.")
    lines += [f"{p} peak {c['note']}." for p, c in result.get("ceilings", {}).items() if c["note"]]
    lines.append("trace s: tracing and lowering the jitted step; compile s: XLA compiling it (no persistent cache).")
    return "\n".join(lines)


# The GPU check: a GPT that fills an H200 (about 300M parameters at d=1024, 24 layers; T=1024) in bf16 with the
# fused attention kernel. The dry run is the same code path at a size the CPU finishes in seconds.
GPU_GPT = {"batch": 16, "seq_len": 1024, "d_model": 1024, "num_layers": 24, "num_heads": 16, "vocab": 256}
DRY_RUN_GPT = {"batch": 2, "seq_len": 64, "d_model": 64, "num_layers": 2, "num_heads": 2, "vocab": 256}


def gpt_model_flops(cfg: dict) -> float:
    """Model FLOPs of one training step (forward + backward, no rematerialisation), as in the PaLM MFU definition:
    6 x (non-embedding parameters, output head included) per token, plus 12 x layers x T x d per token for the
    attention score and value products."""
    d, layers, t, v = cfg["d_model"], cfg["num_layers"], cfg["seq_len"], cfg["vocab"]
    params = layers * (12 * d * d + 13 * d) + 2 * d + d * v + v
    tokens = cfg["batch"] * t
    return 6.0 * params * tokens + 12.0 * layers * t * d * tokens


def float8_gemm_calls(compiled) -> int:
    """How many of a compiled program's GEMMs XLA made fp8 ones (cuBLASLt's `$f8` calls; none on a CPU)."""
    return sum("$f8" in line for line in compiled.as_text().splitlines() if "custom_call_target" in line)


def _gpt_step_mfu(
    cfg: dict,
    impl: str,
    batch: dict,
    tx,
    peak: dict,
    steps: int,
    repeats: int,
    policy: str = "bf16",
    trace_dir: str | None = None,
) -> dict:
    """Compiles and times the GPT step in `policy` with attention `impl`; its figures, or raises what failed. With
    `trace_dir`, also where its device time goes (`jaxnn.profile.kernel_table.step_breakdown`)."""
    from jaxnn import models, train
    from jaxnn.profile.kernel_table import step_breakdown

    gpt_cfg = gpt_config(cfg, attention_implementation=impl)
    model = models.GPT(gpt_cfg)
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, policy)
    step = train.make_train_step(model, train.language_model_loss, tx, policy)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    run_step = stepper(compiled, state, batch)
    timing = time_fn(run_step, warmup=2, repeats=repeats, number=steps)
    model_flops = gpt_model_flops(cfg)
    kernels = {} if trace_dir is None else {"kernels": step_breakdown(run_step, compiled, trace_dir)}
    return {
        **kernels,
        "attention": impl,
        "policy": policy,
        "float8_gemm_calls": float8_gemm_calls(compiled),
        "compile_s": compile_s,
        "num_params": gpt_cfg.num_params(),
        "step_s": timing.median,
        "timing": timing.as_dict(),
        "tokens_per_s": cfg["batch"] * cfg["seq_len"] / timing.median,
        "model_flops_per_step": model_flops,
        "model_tflops": model_flops / timing.median / 1e12,
        "compiled_flops_per_step": flops_of(compiled),
        "mfu": model_flops / timing.median / (peak["gflops"] * 1e9),
    }


# The fp8 policy the MFU child times against bf16: current scaling ("fp8") measured no faster on the first GPU run
# (86.29 against 85.64 ms, H200, 2026-12-04); delayed scaling takes the passes over each operand out of the step.
FP8_POLICY = "fp8-delayed"


def _fp8_against_bf16(
    cfg: dict, impl: str, batch: dict, tx, bf16: dict, steps: int, repeats: int, trace_dir: str | None = None
) -> dict:
    """The same step under FP8_POLICY (Dense products in float8, jaxnn.fp8): its time against bf16's and how many
    of its GEMMs XLA made fp8 ones (cuBLASLt's `$f8` calls on Hopper; none on a CPU, where it is emulated)."""
    try:
        fp8 = _gpt_step_mfu(cfg, impl, batch, tx, bf16["peak"], steps, repeats, FP8_POLICY, trace_dir=trace_dir)
    except Exception as err:  # the bf16 figures stand without it
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    keys = ("step_s", "timing", "compile_s", "float8_gemm_calls", "model_tflops", "kernels")
    speedup = bf16["step_s"] / fp8["step_s"]
    return {"policy": FP8_POLICY, **{k: fp8[k] for k in keys if k in fp8}, "speedup_over_bf16": speedup}


def packed_gpt_batch(cfg: dict, seed: int = 0) -> tuple[dict, float]:
    """`cfg["batch"]` windows of random documents (T/16 to T/2 tokens each) packed as `jaxnn train --pack` packs
    them (`jaxnn.data.packing.pack_documents`: segment ids, positions restarting per document, a loss mask), and the
    share of their positions that hold a real token."""
    from jaxnn.data.packing import pack_documents

    rng = np.random.default_rng(seed)
    T, B = cfg["seq_len"], cfg["batch"]
    documents, pairs = [], 0
    while pairs < B * T:  # enough documents for B windows whatever the packing leaves empty
        documents.append(rng.integers(0, cfg["vocab"], int(rng.integers(T // 16 + 1, T // 2 + 2)), dtype=np.int32))
        pairs += len(documents[-1]) - 1
    arrays = {k: v[:B] for k, v in pack_documents(documents, T).arrays.items()}
    return {k: jnp.asarray(v) for k, v in arrays.items()}, float(np.mean(arrays["segment_ids"] != 0))


def _packed_against_unpacked(
    cfg: dict, impl: str, _batch, tx, unpacked: dict, steps: int, repeats: int, trace_dir: str | None = None
) -> dict:
    """The same bf16 step on packed windows (attention kept within each document): its MFU against the unpacked
    step's (it packs its own batch). Model FLOPs count every position, as the unpacked step's do, so the ratio
    compares the steps' speed."""
    batch, real = packed_gpt_batch(cfg)
    try:
        packed = _gpt_step_mfu(cfg, impl, batch, tx, unpacked["peak"], steps, repeats, trace_dir=trace_dir)
    except Exception as err:  # the unpacked figures stand without it
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    keys = ("step_s", "timing", "compile_s", "model_tflops", "mfu", "kernels")
    return {
        **{k: packed[k] for k in keys if k in packed},
        "real_token_share": real,
        "mfu_over_unpacked": packed["mfu"] / unpacked["mfu"],
    }


def gpu_mfu(out_dir, dry_run: bool = False, *, steps: int = 3, repeats: int = 5) -> dict:
    """Trains the GPU-sized GPT in bf16 and returns its model FLOP utilisation against the bf16 GEMM peak measured
    in the same run, then the fp8 policy's step and the bf16 step on packed batches against it; writes the result
    to `out_dir/gpu_mfu.json`, also when it fails (then `mfu` is None and `notes` says why). `dry_run` shrinks the
    model to run on a CPU.

    Attention uses the cuDNN fused kernel on GPUs ("cudnn"); if that kernel fails to compile or to run, the XLA
    path is timed instead and the result says so.
    """
    import optax

    from jaxnn import train

    cfg = DRY_RUN_GPT if dry_run else GPU_GPT
    on_gpu = jax.default_backend() == "gpu"
    path = os.path.join(out_dir, "gpu_mfu.json")
    os.makedirs(out_dir, exist_ok=True)
    result: dict = {"config": cfg, "dry_run": dry_run, "device": str(jax.devices()[0]), "jax": jax.__version__}
    result.update(mfu=None, notes=[])

    def save() -> None:
        # Written after every stage, so that a crash or the time limit still leaves what was measured.
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
        os.replace(path + ".tmp", path)

    try:
        result["peak"] = measure_matmul_peak(256 if dry_run else 8192, jnp.bfloat16, repeats=repeats)
        save()
        tokens = np.random.default_rng(0).integers(0, cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1), dtype=np.int32)
        batch = {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
        tx = optax.adamw(3e-4, weight_decay=0.1, mask=train.weight_decay_mask)
        for impl in ["cudnn", "xla"] if on_gpu else ["auto"]:
            try:
                traces = os.path.join(out_dir, "traces")
                bf16 = _gpt_step_mfu(cfg, impl, batch, tx, result["peak"], steps, repeats, trace_dir=f"{traces}/bf16")
                result.update(bf16)
                save()
                # Each part is marked as started first: a child killed by its timeout leaves a file that says so.
                for part, measure in (("fp8", _fp8_against_bf16), ("packed", _packed_against_unpacked)):
                    result[part] = {"error": "started, not finished (the child's time ran out)"}
                    save()
                    result[part] = measure(cfg, impl, batch, tx, result, steps, repeats, trace_dir=f"{traces}/{part}")
                break
            except Exception as err:  # e.g. no cuDNN attention for this GPU/jax build: record it, try the next one
                result["notes"].append(f"attention {impl!r} failed: {type(err).__name__}: {err}"[:500])
                save()
    finally:
        save()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_steps", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--quick", action="store_true", help="fewer timing windows and a smaller peak GEMM")
    parser.add_argument("--no-scan", action="store_true", help="skip the K-steps-per-call variant")
    add_json_flags(parser, "also write the results as JSON to PATH")
    parser.add_argument("--gpu", action="store_true", help="run the GPU GPT MFU check instead (gpu_mfu)")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: a tiny GPT that runs on the CPU")
    parser.add_argument("--out-dir", default="results/bench", help="with --gpu: where gpu_mfu.json goes")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    if args.gpu:
        if jax.default_backend() != "gpu" and not args.dry_run:
            print(
                f"bench --gpu: no GPU here (backend is {jax.default_backend()!r}); "
                "use --dry-run to check it on the CPU",
                file=sys.stderr,
            )
            return 2
        res = gpu_mfu(args.out_dir, dry_run=args.dry_run)
        mfu = res.get("mfu")
        print(
            f"GPT {params_label(res.get('num_params', 0))} params, T={res['config']['seq_len']}, bf16, attention "
            f"{res.get('attention')}: {res.get('step_s', float('nan')) * 1e3:.1f} ms/step, "
            f"{res.get('model_tflops', float('nan')):.3g} model TFLOP/s; bf16 GEMM peak "
            f"{res['peak']['gflops'] / 1e3:.3g} TFLOP/s; MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}"
            f"{' (dry run)' if args.dry_run else ''}"
        )
        by_kind = (res.get("kernels") or {}).get("by_kind")
        if by_kind:
            print("bf16 step's device time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in by_kind.items()))
        fp8 = res.get("fp8") or {}
        if "step_s" in fp8:
            print(
                f"{fp8['policy']}: {fp8['step_s'] * 1e3:.1f} ms/step, {fp8['speedup_over_bf16']:.2f}x bf16's speed, "
                f"{fp8['float8_gemm_calls']} fp8 GEMM calls"
            )
        packed = res.get("packed") or {}
        if "step_s" in packed:
            print(
                f"packed batches ({100 * packed['real_token_share']:.0f}% real tokens): {packed['step_s'] * 1e3:.1f} "
                f"ms/step, MFU {100 * packed['mfu']:.1f}%, {packed['mfu_over_unpacked']:.2f}x the unpacked MFU"
            )
        errors = [f"{part}: {r['error']}" for part, r in (("fp8", fp8), ("packed", packed)) if "error" in r]
        for note in [*res["notes"], *errors]:
            print("note:", note)
        return 0 if mfu is not None else 1
    result = run_benchmarks(
        args.models,
        args.precisions,
        quick=args.quick,
        scan=not args.no_scan,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_report(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
