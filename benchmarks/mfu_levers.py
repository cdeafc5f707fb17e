"""`make gpu-levers`: what each lever does to the MFU of the GPU GPT's bf16 step (benchmarks.train_steps.GPU_GPT),
one lever at a time, each timed side by side with the plain step in the same process.

First, fp8 where products dominate: the bf16, fp8 and fp8-delayed steps of a wider GPT (d 2048, 8 layers), side by
side. Then the levers: a larger batch, remat, XLA's GPU compiler options (passed to this step's compile alone, so
one process measures them all), Adam's first moment in bf16. Each result is written before the next lever starts
(and marked "started" before it runs), so a run stopped at its time limit keeps what it measured and says what it
lost; levers that the budget leaves no room for are recorded as not run, with the time that was left.

    python -m benchmarks.mfu_levers --out-dir results/bench/gpu-levers --budget-s 240
    python -m benchmarks.mfu_levers --dry-run --out-dir /tmp/levers   # the same code path, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.train_steps import DRY_RUN_GPT, GPU_GPT, float8_gemm_calls, gpt_config, gpt_model_flops
from jaxnn._src.storage import write_json_atomic
from jaxnn.profile.timing import measure_matmul_peak, stepper, time_interleaved

# Each lever changes one thing of the plain step: the batch ("batch"), the GPT's remat policy ("remat"), Adam's
# first-moment dtype ("mu_dtype") or XLA's compile options ("compiler_options", GPU options: a CPU compile
# accepts and ignores them). In the order they run: the likeliest gains first.
LEVERS: dict[str, dict[str, Any]] = {
    "batch x2": {"batch_scale": 2},
    "GEMMs on cuBLAS only (no Triton GEMM fusions)": {"compiler_options": {"xla_gpu_enable_triton_gemm": False}},
    "cuDNN layer norm": {"compiler_options": {"xla_gpu_enable_cudnn_layer_norm": True}},
    "Adam's first moment in bf16": {"mu_dtype": "bfloat16"},
    "no CUDA graphs (command buffers off)": {"compiler_options": {"xla_gpu_enable_command_buffer": ""}},
    "latency-hiding scheduler": {"compiler_options": {"xla_gpu_enable_latency_hiding_scheduler": True}},
    "batch x2, remat of everything but products": {"batch_scale": 2, "remat": "dots"},
}
WINDOWS = 5  # interleaved timing windows per lever (each runs the plain step and the lever's in turn)
# fp8 against bf16 where products dominate (widths 2048-4096, 8+ layers, as fp8 recipes are measured): the bf16,
# fp8 (current scaling) and fp8-delayed steps of one wider GPT, timed side by side before the levers.
FP8_GPT = {**GPU_GPT, "batch": 8, "d_model": 2048, "num_layers": 8, "num_heads": 16}
FP8_POLICIES = ("bf16", "fp8", "fp8-delayed")


def logits_share(cfg: dict) -> float:
    """The next-token logits' f32 bytes (written, read back by the loss and its gradient) over the bf16 weights'
    and activations' bytes one layer moves: how much a chunked or fused cross-entropy could save at most."""
    b, t, d, v, layers = cfg["batch"], cfg["seq_len"], cfg["d_model"], cfg["vocab"], cfg["num_layers"]
    logits = 3 * 4 * b * t * v
    body = layers * 2 * (12 * d * d + 34 * b * t * d)  # weights (bf16) and the activations a block keeps (bf16)
    return logits / (logits + body)


def _chunked_loss_note(cfg: dict) -> str:
    share = logits_share(cfg)
    saving = "nothing to save at this size" if share < 0.05 else "not built in jaxnn yet"
    return f"the logits are {100 * share:.1f}% of the bytes a step moves at vocab {cfg['vocab']}: {saving}"


def _variant(cfg: dict, lever: dict, impl: str, seed: int = 0):
    """The compiled step of `lever` (a LEVERS entry; {} is the plain step), its stepper and its model FLOPs."""
    import optax

    from jaxnn import models, train

    spec = {**cfg, "batch": cfg["batch"] * lever.get("batch_scale", 1)}
    extra = {"remat": lever["remat"]} if "remat" in lever else {}
    model = models.GPT(gpt_config(spec, attention_implementation=impl, **extra))
    mu_dtype = jnp.dtype(lever["mu_dtype"]) if "mu_dtype" in lever else None
    tx = optax.adamw(3e-4, weight_decay=0.1, mask=train.weight_decay_mask, mu_dtype=mu_dtype)
    tokens = np.random.default_rng(seed).integers(0, spec["vocab"], (spec["batch"], spec["seq_len"] + 1))
    batch = {"x": jnp.asarray(tokens[:, :-1], jnp.int32), "y": jnp.asarray(tokens[:, 1:], jnp.int32)}
    policy = lever.get("policy", "bf16")
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, policy)
    step = train.make_train_step(model, train.language_model_loss, tx, policy)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile(compiler_options=lever.get("compiler_options") or None)
    return stepper(compiled, state, batch), gpt_model_flops(spec), time.perf_counter() - t0


def _measure(name: str, lever: dict, cfg: dict, impl: str, plain, plain_flops: float, peak_flops: float) -> dict:
    """The lever's step timed side by side with the plain one: both MFUs and their ratio."""
    t0 = time.perf_counter()
    run, flops, compile_s = _variant(cfg, lever, impl)
    timings = time_interleaved({"plain": plain, name: run}, warmup=2, repeats=WINDOWS)
    plain_s, lever_s = timings["plain"].median, timings[name].median
    return {
        "lever": lever,
        "step_s": lever_s,
        "plain_step_s": plain_s,
        "mfu": flops / lever_s / peak_flops,
        "plain_mfu": plain_flops / plain_s / peak_flops,
        "mfu_over_plain": (flops / lever_s) / (plain_flops / plain_s),
        "compile_s": compile_s,
        "took_s": time.perf_counter() - t0,
    }


def fp8_at_width(cfg: dict, impl: str) -> dict:
    """The bf16, fp8 and fp8-delayed steps of `cfg`'s GPT timed side by side: each one's time, its speed over
    bf16's and how many of its GEMMs XLA made fp8 ones (cuBLASLt's `$f8` calls; none on a CPU, emulated)."""
    runs = {policy: _variant(cfg, {"policy": policy}, impl) for policy in FP8_POLICIES}
    timings = time_interleaved({policy: run for policy, (run, _, _) in runs.items()}, warmup=2, repeats=WINDOWS)
    bf16_s = timings["bf16"].median
    out = {}
    for policy, (run, _, compile_s) in runs.items():
        out[policy] = {
            "step_s": timings[policy].median,
            "speedup_over_bf16": bf16_s / timings[policy].median,
            "compile_s": compile_s,
            "float8_gemm_calls": float8_gemm_calls(run.step_fn),
        }
    return out


def run_levers(out_dir: str, *, dry_run: bool = False, budget_s: float = 240.0, only: list[str] | None = None) -> dict:
    """Measures each lever (all of LEVERS, or `only`) within `budget_s` seconds; writes and returns the record."""
    cfg = DRY_RUN_GPT if dry_run else GPU_GPT
    on_gpu = jax.default_backend() == "gpu"
    impl = "cudnn" if on_gpu else "auto"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "mfu_levers.json")
    start = time.perf_counter()
    record: dict[str, Any] = {
        "config": cfg,
        "dry_run": dry_run,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "attention": impl,
        "budget_s": budget_s,
        "levers": {},
        "not_tried": {"chunked cross-entropy": _chunked_loss_note(cfg)},
    }

    def save() -> None:
        write_json_atomic(path, record)

    record["fp8_at_width"] = {"config": DRY_RUN_GPT if dry_run else FP8_GPT, "error": "started, not finished"}
    save()
    try:
        record["fp8_at_width"].update(fp8_at_width(record["fp8_at_width"]["config"], impl))
        del record["fp8_at_width"]["error"]
    except Exception as err:  # out of memory, an fp8 path this GPU lacks: recorded, the levers still run
        record["fp8_at_width"]["error"] = f"{type(err).__name__}: {err}"[:500]
    save()
    peak = measure_matmul_peak(256 if dry_run else 8192, jnp.bfloat16, repeats=3)
    record["peak_gflops"] = peak["gflops"]
    plain, plain_flops, plain_compile_s = _variant(cfg, {}, impl)
    record["plain_compile_s"] = plain_compile_s
    save()
    for name in only or list(LEVERS):
        left = budget_s - (time.perf_counter() - start)
        # A lever costs a compile and its windows: about the plain step's compile and more again.
        needed = 2 * plain_compile_s + 5
        if left < needed:
            record["levers"][name] = {"not_run": f"budget: {left:.0f} s left, a lever needs about {needed:.0f} s"}
            continue
        record["levers"][name] = {"error": "started, not finished (the run's time ran out)"}
        save()
        try:
            record["levers"][name] = _measure(name, LEVERS[name], cfg, impl, plain, plain_flops, peak["gflops"] * 1e9)
        except Exception as err:  # an option this XLA does not know, memory: recorded, the next lever runs
            record["levers"][name] = {"error": f"{type(err).__name__}: {err}"[:500]}
        save()
    record["took_s"] = time.perf_counter() - start
    save()
    return record


def format_levers(record: dict) -> str:
    lines = []
    wide = record.get("fp8_at_width", {})
    if "error" in wide:
        lines.append(f"fp8 at width: {wide['error']}")
    else:
        c = wide["config"]
        lines.append(f"fp8 at width (GPT d {c['d_model']}, {c['num_layers']} layers, batch {c['batch']}):")
        lines += [
            f"  {policy:<12} {wide[policy]['step_s'] * 1e3:>8.1f} ms/step {wide[policy]['speedup_over_bf16']:>5.2f}x "
            f"bf16's speed, {wide[policy]['float8_gemm_calls']} fp8 GEMM calls"
            for policy in FP8_POLICIES
        ]
    lines.append(f"{'lever':<48} {'ms/step':>8} {'plain ms':>8} {'MFU':>6} {'vs plain':>8}")
    for name, r in record["levers"].items():
        if "step_s" in r:
            lines.append(
                f"{name[:48]:<48} {r['step_s'] * 1e3:>8.1f} {r['plain_step_s'] * 1e3:>8.1f} "
                f"{100 * r['mfu']:>5.1f}% {r['mfu_over_plain']:>7.2f}x"
            )
        else:
            lines.append(f"{name[:48]:<48} {r.get('not_run') or r.get('error')}")
    lines += [f"{name}: not tried: {why}" for name, why in record["not_tried"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mfu_levers", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="results/bench/gpu-levers", help="where mfu_levers.json goes")
    parser.add_argument("--budget-s", type=float, default=240.0, help="seconds for all levers (default 240)")
    parser.add_argument("--only", nargs="+", choices=list(LEVERS), help="these levers only")
    parser.add_argument("--dry-run", action="store_true", help="a tiny GPT that runs on the CPU")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.dry_run:
        backend = jax.default_backend()
        print(f"mfu_levers: no GPU here (backend {backend!r}); --dry-run runs it on the CPU", file=sys.stderr)
        return 2
    record = run_levers(args.out_dir, dry_run=args.dry_run, budget_s=args.budget_s, only=args.only)
    print(format_levers(record))
    print(f"wrote {os.path.join(args.out_dir, 'mfu_levers.json')} in {record['took_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
