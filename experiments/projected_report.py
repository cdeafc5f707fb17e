"""REPORT.md's projected GPU column: each claim's figures for an H200 from `jaxnn.profile.projection.GpuModel`
applied to the costs of the programs this machine measured (`experiments.projected`), next to the measured CPU
figures of the same programs. Every cell and verdict here is labelled projected, not measured; none replaces a
measured one. Where a GPU run measured the same figure, the cell adds measured / projected, the model's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from experiments import exp_inference, exp_matmul, exp_pipeline, exp_sequential
from experiments.gpu_check import TENSOR_CORE_MIN_TFLOPS
from jaxnn.profile.projection import GpuModel, ProgramCost

LABEL = "projected, not measured"
NOT_PROJECTED = "not projected"


class Projection:
    """The model, the program costs, the CPU whose measurements the projections are set against (the one the
    programs were compiled on when it has results, else the newest), and the first measured GPU, if any."""

    def __init__(self, costs: dict, cpu_tags: list[str], gpu_tags: list[str], get: Callable, model=None):
        self.model = model or GpuModel()
        self.costs, self.get = costs, get
        compiled_on = costs.get("compiled_on")
        self.cpu = compiled_on if compiled_on in cpu_tags else (cpu_tags[-1] if cpu_tags else None)
        self.gpu = gpu_tags[0] if gpu_tags else None

    def header(self) -> str:
        return f"GPU H200 ({LABEL})"

    def rows(self, name: str, at: str | None = None, **key) -> list[tuple[dict, ProgramCost]]:
        """The programs of `name` whose fields match `key`, compiled at the size preset `at` (default: the costs'
        own, the CPU runs'; rows without a "size" were all compiled at it)."""
        fields = ProgramCost.__dataclass_fields__
        want = at or self.costs.get("size")
        out = []
        for row in self.costs["programs"].get(name, []):
            if row.get("size", want) == want and all(row.get(k) == v for k, v in key.items()):
                out.append((row, ProgramCost(**{k: row[k] for k in fields})))
        return out

    def cost(self, name: str, at: str | None = None, **key) -> ProgramCost:
        found = self.rows(name, at, **key)
        if not found:
            raise KeyError(f"no projected program {name} {key} at {at or self.costs.get('size')}")
        return found[0][1]

    def measured_at(self, name: str) -> str | None:
        """The size preset whose programs the GPU run of `name` measured, when its programs were compiled: the
        costs' own size (also when the run names none), or the GPU run's own; None when they were not."""
        rec = self.measured(name) or {}
        size, own = rec.get("size"), self.costs.get("size")
        if size is None or size == own:
            return own
        return size if self.rows(name, size) else None

    def measured(self, name: str) -> dict | None:
        return self.get(self.gpu, name) if self.gpu else None

    def cpu_record(self, name: str) -> dict:
        rec = self.get(self.cpu, name) if self.cpu else None
        if rec is None:
            raise KeyError(f"no CPU results for {name}")
        return rec

    def sources(self) -> list[str]:
        m = self.model
        return [
            "- peaks: " + ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in m.peaks.items()),
            f"- memory bandwidth {m.bandwidth / 1e12:g} TB/s; kernel launch {m.launch_s * 1e6:g} µs; "
            f"dispatch {m.dispatch_s * 1e6:g} µs per call; host-device copies {m.transfer_bandwidth / 1e9:g} GB/s "
            f"and {m.transfer_latency_s * 1e6:g} µs each",
            *(f"- {k}: {v}" for k, v in m.sources.items()),
        ]


# exp_matmul's dtype names -> the model's kinds of arithmetic whose peak that product measures.
MATMUL_KINDS = {"bf16": ("bf16", "fp16"), "f16": ("fp16",), "f32": ("fp32",), "tf32": ("tf32",)}


def refit(p: Projection) -> tuple[GpuModel, list[str]] | None:
    """The model's parameters refit from the measured GPU run, and one line per parameter changed: each peak from
    exp_matmul's fastest product of its dtype; the kernel launch from exp_sequential's smallest chain (its
    measured time less the model's roofline and loop latencies, over the kernels the compiled chain has). None
    without a GPU run. Use it as `Projection(..., model=refit(p)[0])` to project with the measured figures."""
    if p.gpu is None:
        return None
    m, notes, peaks = p.model, [], dict(p.model.peaks)
    rows = [r for r in (p.measured("exp_matmul") or {}).get("rows", []) if r.get("backend") == "gpu"]
    for dtype, kinds in MATMUL_KINDS.items():
        rates = [r["gflops"] * 1e9 for r in rows if r.get("dtype") == dtype and r.get("gflops")]
        for kind in kinds if rates else ():
            peaks[kind] = max(rates)
            notes.append(f"- peak {kind}: {m.peaks.get(kind, 0) / 1e12:g} -> {peaks[kind] / 1e12:.4g} TFLOP/s")
    launch = m.launch_s
    chains = [
        r
        for r in (p.measured("exp_sequential") or {}).get("rows", [])
        if r.get("case") == "chain" and r.get("backend") == "gpu"
    ]
    row = min(chains, key=lambda r: r["hidden"]) if chains else None
    found = p.rows("exp_sequential", case="chain", hidden=row["hidden"]) if row else []
    if row and found:  # a chain the GPU ran and whose compiled program's costs are on record
        cost = found[0][1]
        roofline = dataclasses.replace(m, peaks=peaks).roofline_s(cost)
        rest = row["median"] - roofline - cost.loop_trips * m.transfer_latency_s
        if rest > 0:
            launch = rest / cost.kernels
            notes.append(
                f"- kernel launch: {m.launch_s * 1e6:g} -> {launch * 1e6:.3g} µs (exp_sequential chain, hidden "
                f"{row['hidden']}: {row['median'] * 1e3:.3g} ms measured for {cost.kernels} kernels)"
            )
    return dataclasses.replace(m, peaks=peaks, launch_s=launch), notes


def _shown(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def vs(text: str, projected: float | None, measured: float | None) -> str:
    """A projected cell; with a measured GPU figure of the same quantity, the measured one and their ratio."""
    if measured is None or not projected:
        return text
    return f"{text}; measured {_shown(measured)}, measured/projected {measured / projected:.2f}x"


def vs_run(p: Projection, name: str, text: str, projected: Callable[[str], float], measured: float | None) -> str:
    """`vs` for an experiment a GPU run may measure at its own sizes (another model, batch or CNN than the CPU's):
    the ratio is to the projection of the program it ran (`projected(size)`), given beside it when that is not
    the cell's own; without those programs' costs, the measurement alone."""
    if measured is None:
        return text
    at, own = p.measured_at(name), p.costs.get("size")
    if at == own:
        return vs(text, projected(own), measured)
    try:
        value = projected(at) if at is not None else None
    except KeyError:  # a figure the GPU run measured at a size its programs were not compiled at
        value = None
    if not value:
        return f"{text}; measured {_shown(measured)} at the GPU run's sizes (not compiled here)"
    return (
        f"{text}; measured {_shown(measured)}, projected {_shown(value)} at the GPU run's sizes, "
        f"measured/projected {measured / value:.2f}x"
    )


def _gflops(cost: ProgramCost, p: Projection) -> float:
    return cost.flops / p.model.queued_s(cost) / 1e9


# ------------------------------------------------------------------------------------------------ claim 1


def _mm_gpu(p: Projection, dtype: str, n: int) -> float | None:
    rec = p.measured("exp_matmul")
    rows = [r for r in (rec or {}).get("rows", []) if r["backend"] != "cpu" and r["dtype"] == dtype and r["n"] == n]
    return rows[0]["gflops"] if rows else None


def _mm_best(p: Projection, dtype: str) -> str:
    g, n = max((_gflops(c, p), r["n"]) for r, c in p.rows("exp_matmul", dtype=dtype))
    return vs(f"{g:,.0f} GFLOP/s (n={n})", g, _mm_gpu(p, dtype, n))


def _mm_vs_cpu(p: Projection) -> tuple[dict[int, float], int | None]:
    """CPU time / projected GPU time per fp32 size the reference CPU measured, and the projected overtake size."""
    cpu = {
        r["n"]: r["median"] for r in p.cpu_record("exp_matmul")["rows"] if r["backend"] == "cpu" and r["dtype"] == "f32"
    }
    ratio = {n: t / p.model.queued_s(p.cost("exp_matmul", dtype="f32", n=n)) for n, t in sorted(cpu.items())}
    overtake = next((n for n in ratio if all(ratio[m] > 1 for m in ratio if m >= n)), None)
    return ratio, overtake


def matmul_cells(p: Projection) -> dict[str, Callable[[], str]]:
    peak = p.model.peaks["bf16"] / 1e9

    def speedup() -> str:
        ratio, _ = _mm_vs_cpu(p)
        n = max(ratio)
        return f"{ratio[n]:.2f}x (n={n}, vs `{p.cpu}` measured)"

    return {
        "best fp32 (exact)": lambda: _mm_best(p, "f32"),
        "best bf16 -> fp32": lambda: _mm_best(p, "bf16"),
        "measured bf16 peak": lambda: vs(
            f"{peak:,.0f} GFLOP/s (the model's peak)",
            peak,
            ((p.measured("exp_matmul") or {}).get("peaks", {}).get("gpu") or {}).get("gflops"),
        ),
        "accelerator / host CPU, largest fp32": speedup,
        "accelerator overtakes the CPU from n =": lambda: str(_mm_vs_cpu(p)[1]),
    }


def verdict_matmul(p: Projection) -> tuple[str, str]:
    ratio, overtake = _mm_vs_cpu(p)
    n = max(ratio)
    x = ratio[n]
    verdict = "confirmed" if x >= 5 else "refuted" if x < 1 else "depends"
    return verdict, f"an fp32 {n}^3 product projected {x:.1f}x faster than measured on `{p.cpu}`; from n={overtake}"


# ------------------------------------------------------------------------------------------------ claim 2


def _per_step(p: Projection, case: str) -> tuple[int, float]:
    hidden = min(r["hidden"] for r, _ in p.rows("exp_sequential", case=case))
    row, cost = p.rows("exp_sequential", case=case, hidden=hidden)[0]
    return hidden, p.model.queued_s(cost) / row["steps"] * 1e6


def _measured_step(p: Projection, case: str, hidden: int) -> float | None:
    rec = p.measured("exp_sequential")
    per = exp_sequential.summary(rec)["per_step_us"] if rec else {}
    return next((v[case].get(hidden) for b, v in per.items() if b != "cpu" and case in v), None)


def latency_cells(p: Projection) -> dict[str, Callable[[], str]]:
    def step(case: str) -> str:
        hidden, us = _per_step(p, case)
        return vs(f"{us:.2f} µs (hidden {hidden})", us, _measured_step(p, case, hidden))

    def penalty() -> str:
        hidden = min(r["hidden"] for r, _ in p.rows("exp_sequential", case="chain"))
        chain, par = (p.cost("exp_sequential", case=c, hidden=hidden) for c in ("chain", "chain_parallel"))
        return f"{p.model.queued_s(chain) / p.model.queued_s(par):.1f}x"

    def smallest() -> str:
        n = min(r["n"] for r, _ in p.rows("exp_matmul", dtype="f32"))
        us = p.model.queued_s(p.cost("exp_matmul", dtype="f32", n=n)) * 1e6
        rec = p.measured("exp_matmul")
        lat = exp_matmul.summary(rec).get("latency_us", {}).get(n, {}) if rec else {}
        return vs(f"{us:.1f} µs (n={n})", us, next((v for b, v in lat.items() if b != "cpu"), None))

    return {
        "GPU: µs per dependent step (chain)": lambda: step("chain"),
        "GPU: µs per dependent step (RNN)": lambda: step("rnn"),
        "GPU: chain time / equal-FLOP parallel product": penalty,
        "smallest fp32 product, GPU": smallest,
    }


def verdict_latency(p: Projection) -> tuple[str, str]:
    cpu = exp_sequential.summary(p.cpu_record("exp_sequential"))["per_step_us"]["cpu"]
    wins, parts = [], []
    for case in ("chain", "rnn"):
        hidden, us = _per_step(p, case)
        cpu_us = cpu[case][hidden] if hidden in cpu[case] else cpu[case][str(hidden)]
        wins.append(cpu_us < us)
        parts.append(f"{case} {cpu_us:.2f} µs/step measured vs {us:.2f} projected (hidden {hidden})")
    mm = {
        r["n"]: r["median"] for r in p.cpu_record("exp_matmul")["rows"] if r["backend"] == "cpu" and r["dtype"] == "f32"
    }
    small = [n for n, t in sorted(mm.items()) if t < p.model.queued_s(p.cost("exp_matmul", dtype="f32", n=n))]
    verdict = "confirmed" if all(wins) and small else "refuted" if not any(wins) and not small else "depends"
    products = f"CPU faster on products of n in {small}" if small else "CPU faster on no product size measured"
    return verdict, f"`{p.cpu}` against the model: " + "; ".join(parts) + f"; {products}"


# ------------------------------------------------------------------------------------------------ claim 3


def _prec(p: Projection) -> dict[str, tuple[float, int]]:
    return {r["mode"]: (_gflops(c, p), r["n"]) for r, c in p.rows("exp_precision", op="matmul")}


def precision_cells(p: Projection) -> dict[str, Callable[[], str]]:
    def cell(mode: str) -> str:
        g = _prec(p)
        rec = p.measured("exp_precision")
        measured = next(
            (r["gflops"] for r in (rec or {}).get("rows", []) if (r["op"], r["mode"]) == ("matmul", mode)), None
        )
        return vs(f"{g[mode][0]:,.0f}; {g[mode][0] / g['fp32'][0]:.2f}x; - (n={g[mode][1]})", g[mode][0], measured)

    return {f"matmul {mode}: GFLOP/s, speedup, rel. error": (lambda mode=mode: cell(mode)) for mode in _MODES}


_MODES = ("fp32", "tf32", "bf16", "fp16", "bf16_out")


def verdict_tensor_cores(p: Projection) -> tuple[str, str]:
    g = _prec(p)
    x, rate = g["bf16"][0] / g["fp32"][0], g["bf16"][0] / 1e3
    verdict = "confirmed" if x >= 8 and rate >= TENSOR_CORE_MIN_TFLOPS else "depends" if x >= 2 else "refuted"
    return verdict, f"bf16 product {x:.1f}x exact fp32 at {rate:,.0f} TFLOP/s (n={g['bf16'][1]}): the model's peaks"


# ------------------------------------------------------------------------------------------------ claim 5


def _pipeline(p: Projection, at: str | None = None, rec: dict | None = None) -> dict[int, dict[str, float]]:
    """Per augmentation cost the reference CPU measured (or `rec`, a run at the size preset `at`): projected step
    seconds of each arrangement, from that run's measured host time per batch and the model's device step."""
    rec = rec or p.cpu_record("exp_pipeline")
    plain = p.cost("exp_pipeline", at, step="plain")
    batch, threads = next(r["batch"] for r in rec["rows"]), rec.get("threads", 1)
    out = {}
    for key, timing in rec["host_batch"].items():
        c, host = int(key), timing["median"]
        device = p.model.device_s(plain)
        out[c] = {
            "batch": batch,
            "device": device,
            "sync": p.model.dispatch_s + host + p.model.transfer_s(plain.h2d_bytes) + device,
            "overlapped": max(host / threads, p.model.queued_s(plain)),
            "device_aug": p.model.queued_s(p.cost("exp_pipeline", at, step="device", cost=c)),
        }
    return out


SPLIT_RATE_LABEL = "plain step rate, host cores crop+flip needs at it"


def _split_projection(p: Projection) -> tuple[dict, float, float] | None:
    """The real crop+flip's line measured on the reference CPU, the plain step's projected rate (the host
    augments, the device only trains) and the host cores that rate needs; None without a recorded split."""
    split = p.cpu_record("exp_pipeline").get("split") or {}
    if "in_step" not in split:
        return None
    line = exp_pipeline.split_line(split)
    steps_per_s = 1.0 / p.model.queued_s(p.cost("exp_pipeline", step="plain"))
    return line, steps_per_s, steps_per_s / line["steps_per_s_per_core"]


def pipeline_cells(p: Projection, costs: list[int]) -> dict[str, Callable[[], str]]:
    def cell(c: int, arr: str) -> str:
        v = _pipeline(p)[c]
        step = v["device_aug" if arr == "device" else arr]
        idle = 0.0 if arr == "device" else max(0.0, 1 - v["device"] / step)
        rec = p.measured("exp_pipeline")
        measured = exp_pipeline.summary(rec).get(c, {}).get(arr, {}).get("samples_per_s") if rec else None

        def rate(at: str) -> float:  # at the GPU run's sizes, with the host time its own host measured
            w = _pipeline(p, at, None if at == p.costs.get("size") else rec)[c]
            return w["batch"] / w["device_aug" if arr == "device" else arr]

        return vs_run(p, "exp_pipeline", f"{v['batch'] / step:,.0f} ({idle:.0%})", rate, measured)

    def split_cell() -> str:
        split = _split_projection(p)
        if split is None:
            return NOT_PROJECTED
        return f"{split[1]:,.0f} steps/s, {split[2]:,.2f}"

    cells = {
        f"cost {c}, {arr}: samples/s (device idle)": (lambda c=c, arr=arr: cell(c, arr))
        for c in costs
        for arr in ("sync", "overlapped", "device")
    }
    return {**cells, SPLIT_RATE_LABEL: split_cell}


def verdict_pipeline(p: Projection) -> tuple[str, str]:
    """With the real crop+flip's split recorded on the reference CPU: confirmed when this machine's host cores
    would keep up with the projected step rate, refuted when they would not (the line named); without it, per
    synthetic augmentation cost, the fastest projected arrangement."""
    names = {"sync": "sync", "overlapped": "overlapped", "device_aug": "device"}
    winners = {c: names[min(names, key=lambda a: v[a])] for c, v in sorted(_pipeline(p).items())}
    kinds = set(winners.values())
    verdict = "confirmed" if kinds == {"overlapped"} else "refuted" if kinds == {"device"} else "depends"
    text = "synthetic cost, fastest per augmentation cost: " + ", ".join(f"{c}: {w}" for c, w in winners.items())
    text += f" (host time per batch measured on `{p.cpu}`, the device step projected)"
    split = _split_projection(p)
    if split is None:
        return verdict, text
    line, steps_per_s, needed = split
    verdict = "confirmed" if needed <= line["cores"] else "refuted"
    return verdict, (
        f"real crop+flip: one host core of `{p.cpu}` keeps up with {line['steps_per_s_per_core']:,.0f} steps/s; "
        f"the projected {steps_per_s:,.0f} steps/s would need {needed:,.0f} such cores ({line['cores']} here); {text}"
    )


# ------------------------------------------------------------------------------------------------ claim 6


def _samples(p: Projection, batch: int, at: str | None = None) -> float:
    return batch / p.model.queued_s(p.cost("exp_parallel", at, global_batch=batch))


def batch_cells(p: Projection, batches: list[int]) -> dict[str, Callable[[], str]]:
    def cell(b: int) -> str:
        rec = p.measured("exp_parallel")
        measured = next((r["samples_per_s"] for r in (rec or {}).get("sweep", []) if r["global_batch"] == b), None)
        return vs_run(p, "exp_parallel", f"{_samples(p, b):,.0f}", lambda at: _samples(p, b, at), measured)

    return {f"train samples/s, batch {b} (1 device)": (lambda b=b: cell(b)) for b in batches}


def verdict_batches(p: Projection) -> tuple[str, str]:
    sweep = sorted(r["global_batch"] for r in p.cpu_record("exp_parallel")["sweep"])
    lo, hi = _samples(p, sweep[0]), _samples(p, sweep[-1])
    gain = hi / lo
    verdict = "confirmed" if gain >= 3 else "refuted" if gain < 1.5 else "depends"
    return verdict, f"samples/s {lo:,.0f} at batch {sweep[0]} -> {hi:,.0f} at batch {sweep[-1]} ({gain:.1f}x)"


# ------------------------------------------------------------------------------------------------ claim 7


def _inference(p: Projection, model: str, at: str | None = None) -> dict[str, float]:
    rows = p.rows("exp_inference", at, model=model)
    best = max((r["batch"] / p.model.queued_s(c), r["batch"]) for r, c in rows)
    one = p.cost("exp_inference", at, model=model, batch=1)
    return {"batch1_p50_ms": p.model.request_s(one) * 1e3, "best_samples_per_s": best[0], "best_batch": best[1]}


def inference_cells(p: Projection) -> dict[str, Callable[[], str]]:
    def measured(model: str, field: str) -> float | None:
        rec = p.measured("exp_inference")
        per = exp_inference.summary(rec) if rec else {}
        return next((v[model].get(field) for b, v in per.items() if b != "cpu" and model in v), None)

    cells: dict[str, Callable[[], str]] = {}
    for model in ("cnn", "gpt"):
        cells[f"gpu {model}: batch-1 p50 / p99"] = lambda model=model: vs_run(
            p,
            "exp_inference",
            f"{_inference(p, model)['batch1_p50_ms']:.3f} ms (no tail in the model)",
            lambda at: _inference(p, model, at)["batch1_p50_ms"],
            measured(model, "batch1_p50_ms"),
        )
        cells[f"gpu {model}: best samples/s (batch)"] = lambda model=model: vs_run(
            p,
            "exp_inference",
            f"{_inference(p, model)['best_samples_per_s']:,.0f} ({_inference(p, model)['best_batch']})",
            lambda at: _inference(p, model, at)["best_samples_per_s"],
            measured(model, "best_samples_per_s"),
        )
    return cells


def verdict_inference(p: Projection) -> tuple[str, str]:
    cpu = exp_inference.summary(p.cpu_record("exp_inference"))["cpu"]
    halves, parts = [], []
    for model, c in cpu.items():
        g = _inference(p, model)
        halves.append(
            (g["best_samples_per_s"] >= 2 * c["best_samples_per_s"], g["batch1_p50_ms"] >= 0.5 * c["batch1_p50_ms"])
        )
        parts.append(
            f"{model}: best {g['best_samples_per_s']:,.0f} projected vs {c['best_samples_per_s']:,.0f} measured "
            f"samples/s, batch-1 {g['batch1_p50_ms']:.3f} projected vs {c['batch1_p50_ms']:.3f} ms measured"
        )
    both = all(b and r for b, r in halves)
    verdict = "confirmed" if both else "refuted" if not any(b or r for b, r in halves) else "depends"
    return verdict, "; ".join(parts) + f" (`{p.cpu}`)"


VERDICTS = {
    1: verdict_matmul,
    2: verdict_latency,
    3: verdict_tensor_cores,
    5: verdict_pipeline,
    6: verdict_batches,
    7: verdict_inference,
}


def verdict(p: Projection, claim: int) -> tuple[str, str]:
    """The projected verdict of a claim, by the measured rule's thresholds; claim 4 (which library a GPU compiler
    calls) has none: only a GPU's compiled program can say."""
    if claim not in VERDICTS:
        return NOT_PROJECTED, "which library kernels run is known only from a GPU's own compiled program"
    return VERDICTS[claim](p)
