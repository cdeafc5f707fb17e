"""The claims' verdicts: each rule decides confirmed / refuted / depends / not measured from one machine's results,
and `overall` chooses one verdict from the machines' (the GPU's where one was measured).

Each verdict function's docstring states its rule; the thresholds in them are the only numbers here. `report`
builds REPORT.md's sections around them.
"""

from __future__ import annotations

from experiments import exp_inference, exp_matmul, exp_parallel, exp_pipeline, exp_precision, exp_sequential
from experiments.gpu_check import TENSOR_CORE_MIN_TFLOPS

NOT_MEASURED = "not measured"


def is_gpu(tag: str) -> bool:
    """A GPU's results folder: every tag that is not a CPU's (`cpu-...`)."""
    return not tag.startswith("cpu")


LOOKUP_ERRORS = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, StopIteration, AttributeError)


def guard(verdict, *records):
    """A verdict, or 'not measured' naming what was missing when the records lack the rows it is decided on."""
    try:
        return verdict(*records)
    except LOOKUP_ERRORS as err:
        return NOT_MEASURED, f"incomplete results ({type(err).__name__}: {err})"


def overall(verdicts: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """One verdict from per-machine ones: the GPU's where a GPU was measured (the claims are about GPUs)."""
    gpu = {t: v for t, v in verdicts.items() if is_gpu(t) and v[0] != NOT_MEASURED}
    chosen = gpu or {t: v for t, v in verdicts.items() if v[0] != NOT_MEASURED}
    if not chosen:
        return NOT_MEASURED, "; ".join(v[1] for v in verdicts.values()) or "no results files"
    kinds = {v[0] for v in chosen.values()}
    verdict = kinds.pop() if len(kinds) == 1 else "depends"
    reason = "; ".join(f"`{t}`: {v[0]} — {v[1]}" for t, v in chosen.items())
    if not gpu:
        reason += " (CPU only: no GPU results yet)"
    return verdict, reason


# ------------------------------------------------------------------------------------------------ verdicts
# Each takes one machine's results and returns (verdict, the numbers that decide it).


def verdict_matmul(rec: dict | None) -> tuple[str, str]:
    """Confirmed when the accelerator runs the largest fp32 product >= 5x faster than the same machine's CPU;
    refuted when it is slower; depends in between. Needs both backends in one run (a GPU machine)."""
    if not rec:
        return NOT_MEASURED, "no exp_matmul results"
    s = exp_matmul.summary(rec)
    if "speedup_at_largest" not in s:
        best = s["best_gflops"].get("cpu/f32")
        return NOT_MEASURED, (
            f"CPU only (best fp32 {best[0]:.0f} GFLOP/s at n={best[1]}); no GPU here to compare with"
            if best
            else "no accelerator in this run"
        )
    x = s["speedup_at_largest"]
    verdict = "confirmed" if x >= 5 else "refuted" if x < 1 else "depends"
    return verdict, (
        f"{s['accelerator']} is {x:.1f}x the host CPU on an fp32 {s['largest_n']}^3 product; it "
        f"overtakes the CPU from n={s['overtake_n']}"
    )


def verdict_latency(seq: dict | None, mm: dict | None) -> tuple[str, str]:
    """Confirmed when the CPU wins every dependent chain at the smallest hidden size and the smallest products;
    refuted when the accelerator wins them; depends otherwise. Needs both backends in one run."""
    if not seq:
        return NOT_MEASURED, "no exp_sequential results"
    s = exp_sequential.summary(seq)
    if not s["winner"]:
        per = s["per_step_us"].get("cpu", {}).get("chain", {})
        pen = s["sequential_penalty"].get("cpu", {}).get("chain", {})
        if per:
            h = min(per, key=float)
            ratio = f", {pen[h]:.1f}x the time of the equal-FLOP parallel product" if h in pen else ""
            return NOT_MEASURED, (
                f"CPU only: a dependent step costs {per[h]:.2f} µs at hidden {h}{ratio}; no GPU here to compare with"
            )
        return NOT_MEASURED, "no CPU rows"
    small = {case: per[min(per, key=float)] for case, per in s["winner"].items()}
    cpu_wins = [c for c, v in small.items() if v["winner"] == "cpu"]
    mm_small = exp_matmul.summary(mm).get("cpu_faster_sizes", []) if mm else []
    detail = ", ".join(f"{c}: CPU takes {v['cpu_over_accel']:.2f}x the accelerator's time" for c, v in small.items())
    if len(cpu_wins) == len(small) and mm_small:
        verdict = "confirmed"
    elif not cpu_wins and not mm_small:
        verdict = "refuted"
    else:
        verdict = "depends"
    products = f"CPU faster on products of n in {mm_small}" if mm_small else "CPU faster on no product size measured"
    return verdict, f"smallest hidden size: {detail}; {products}"


def verdict_tensor_cores(prec: dict | None) -> tuple[str, str]:
    """On an accelerator: confirmed when bf16 products run >= 8x exact fp32 (the like-for-like figure behind the
    '12x') at a measured rate of at least `gpu_check.TENSOR_CORE_MIN_TFLOPS` (3x the H200's fp32 datasheet rate,
    which no CUDA core reaches), depends from 2x to 8x or below that rate, refuted under 2x. On a CPU: the same
    thresholds for its matrix units."""
    if not prec:
        return NOT_MEASURED, "no exp_precision results"
    s = exp_precision.summary(prec).get("matmul", {})
    bf16 = s.get("bf16", {}).get("speedup")
    if bf16 is None:
        return NOT_MEASURED, "no bf16 matmul"
    err = s["bf16"]["rel_error"]
    extra = ", ".join(
        f"{m} {v['speedup']:.2f}x" for m, v in s.items() if m not in ("fp32", "bf16") and v.get("speedup")
    )
    numbers = f"bf16 x bf16 -> fp32 product {bf16:.2f}x exact fp32 (relative error {err:.1e} vs float64); {extra}"
    if prec["machine"]["backend"] == "cpu":
        # The claim is about GPU tensor cores; a CPU run only says what this CPU's own matrix units give.
        amx = "with" if any(f.startswith("amx") for f in prec["machine"].get("cpu_flags", [])) else "without"
        return NOT_MEASURED, f"no GPU in this run; this CPU ({amx} AMX in its flags): {numbers}"
    verdict = "confirmed" if bf16 >= 8 else "depends" if bf16 >= 2 else "refuted"
    # The ratio alone could come from a slow fp32 path; tensor cores are proven by a bf16 rate no CUDA core reaches.
    rate = s["bf16"].get("gflops")
    if verdict == "confirmed" and (rate is None or rate < TENSOR_CORE_MIN_TFLOPS * 1e3):
        verdict = "depends"
        numbers += f"; but the bf16 rate is under the {TENSOR_CORE_MIN_TFLOPS:.0f} TFLOP/s no CUDA core reaches"
    return verdict, numbers


def verdict_libraries(check: dict | None, prec: dict | None) -> tuple[str, str]:
    """Confirmed when the compiled HLO of a bf16 product calls cuBLAS/cuDNN/Triton GEMMs on bf16 operands (and,
    for convolutions, cuDNN); refuted when a GPU run shows none; not measured without a GPU run."""
    kernels = sorted({k["target"] for r in (prec or {}).get("rows", []) for k in r["kernels"]})
    if not check or check.get("dry_run", True):
        return NOT_MEASURED, (
            f"CPU: XLA's compiled HLO calls {', '.join(kernels) or 'no library kernels'} "
            "(its own code elsewhere); the cuBLAS/cuDNN check needs a GPU run"
        )
    c = check["check"]
    gemm = ", ".join(sorted({g["target"] for g in c.get("gemm_calls", [])})) or "none"
    conv = ", ".join(sorted({k["target"] for k in c.get("conv_calls", [])})) or "none"
    verdict = "confirmed" if c.get("bf16_gemm") else "refuted"
    return verdict, f"bf16 product -> {gemm}; bf16 convolution -> {conv}"


def verdict_pipeline(pipe: dict | None) -> tuple[str, str]:
    """With the real crop+flip measured (`split`): confirmed when the host's cores keep up with the step measured
    here, refuted when they fall behind; the text names the line (steps/s per host core). What a projected
    accelerator would need is the projected verdict's (experiments/projected_report.py), never this one's.
    Without it, per synthetic augmentation cost, the fastest arrangement:
    confirmed when host preprocessing overlapped with the step wins at every cost, refuted when augmenting on the
    device wins at every cost, depends otherwise."""
    if not pipe:
        return NOT_MEASURED, "no exp_pipeline results"
    s = exp_pipeline.summary(pipe)
    if not s:
        return NOT_MEASURED, "no rows"
    winners = {int(c): v["best"] for c, v in s.items()}
    kinds = set(winners.values())
    verdict = "confirmed" if kinds == {"overlapped"} else "refuted" if kinds == {"device"} else "depends"
    top = max(s, key=float)
    sync_idle = s[top].get("sync", {}).get("device_idle")
    idle = (
        ""
        if sync_idle is None
        else f"; in-line (sync) preprocessing leaves the device idle {sync_idle:.0%} of the time"
    )
    synthetic = (
        "synthetic cost, fastest per augmentation cost: "
        + ", ".join(f"{c}: {w}" for c, w in sorted(winners.items()))
        + (f"; at cost {top} the best is {s[top]['best_over_sync']:.2f}x sync" if "best_over_sync" in s[top] else "")
        + idle
    )
    split = pipe.get("split")
    if not split or "in_step" not in split:
        return verdict, synthetic
    line = exp_pipeline.split_line(split)
    here = line["keeps_up_here"]
    verdict = "confirmed" if here else "refuted"
    text = (
        f"the line: one host core prepares {line['steps_per_s_per_core']:,.0f} cropped and flipped batches of "
        f"{line['batch']} a second, so host augmentation keeps up while the step rate stays under "
        f"{line['steps_per_s_per_core']:,.0f} steps/s per host core and belongs in the step above it; "
        f"here ({line['cores']} cores, {split['in_step']['steps_per_s']:,.0f} steps/s) the host "
        f"{'keeps up' if here else 'falls behind'}, and in the step it costs the device "
        f"{split['device_extra_s'] * 1e3:+.2f} ms ({split['device_extra_fraction']:+.0%}) a step; {synthetic}"
    )
    return verdict, text


def verdict_batches(par: dict | None) -> tuple[str, str]:
    """Confirmed when training throughput grows >= 3x from the smallest to the largest batch; refuted under 1.5x."""
    if not par:
        return NOT_MEASURED, "no exp_parallel results"
    g = exp_parallel.summary(par).get("batch_gain")
    if not g:
        return NOT_MEASURED, "no batch sweep"
    verdict = "confirmed" if g["gain"] >= 3 else "refuted" if g["gain"] < 1.5 else "depends"
    return verdict, (
        f"samples/s {g['samples_per_s_from']:.0f} at batch {g['from']} -> "
        f"{g['samples_per_s_to']:.0f} at batch {g['to']} ({g['gain']:.1f}x)"
    )


def verdict_inference(inf: dict | None) -> tuple[str, str]:
    """Needs both backends in one run. Batched half: the accelerator's best throughput >= 2x the CPU's. Real-time
    half: the accelerator's batch-1 p50 latency is not below half the CPU's. Both: confirmed; neither: refuted."""
    if not inf:
        return NOT_MEASURED, "no exp_inference results"
    s = exp_inference.summary(inf)
    accel = [b for b in s if b != "cpu"]
    if not accel or "cpu" not in s:
        cpu = s.get("cpu", {})
        parts = [_cpu_inference(m, v) for m, v in cpu.items()]
        return NOT_MEASURED, "CPU only: " + "; ".join(parts) + "; no GPU here to compare with"
    a = accel[0]
    halves, parts = [], []
    for model in s["cpu"]:
        c, g = s["cpu"][model], s[a].get(model)
        if not g or "batch1_p50_ms" not in c or "batch1_p50_ms" not in g:
            continue
        batched = g["best_samples_per_s"] >= 2 * c["best_samples_per_s"]
        realtime = g["batch1_p50_ms"] >= 0.5 * c["batch1_p50_ms"]
        halves.append((batched, realtime))
        parts.append(
            f"{model}: best {g['best_samples_per_s']:.0f} vs {c['best_samples_per_s']:.0f} samples/s, "
            f"batch-1 p50 {g['batch1_p50_ms']:.2f} vs {c['batch1_p50_ms']:.2f} ms ({a} vs cpu)"
        )
    if not halves:
        return NOT_MEASURED, "no comparable rows"
    if all(b and r for b, r in halves):
        verdict = "confirmed"
    elif not any(b or r for b, r in halves):
        verdict = "refuted"
    else:
        verdict = "depends"
    return verdict, "; ".join(parts)


def _cpu_inference(model: str, v: dict) -> str:
    """One model's CPU inference figures in words, leaving out any the run lacks (never 'nan')."""
    said = []
    if "batch1_p50_ms" in v:
        said.append(f"batch-1 p50 {v['batch1_p50_ms']:.2f} ms")
    if "batching_gain" in v:
        said.append(
            f"batching gives {v['batching_gain']:.1f}x the samples/s of batch 1 (best at batch {v['best_batch']})"
        )
    return f"{model}: {', '.join(said) or 'no figures'}"
