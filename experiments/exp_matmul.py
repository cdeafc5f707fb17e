"""Claims 1 and 2: matrix-product throughput (GFLOP/s) against size on every backend present, next to the peak.

Exact fp32 (`precision=HIGHEST`, so no TF32 on a GPU) and bf16 x bf16 -> fp32 products of n x n matrices. From the
same run: the size at which the accelerator overtakes the host CPU, and the small sizes at which the CPU answers
sooner (latency).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from experiments import common
from experiments.peaks import Ceiling, ceiling
from jaxnn.profile.timing import matmul_flops, measure_matmul_peak, time_fn

NAME = "exp_matmul"

# Largest size per backend and preset; the host CPU of a GPU machine stops earlier because a 8192^3 fp32 product
# takes seconds there and the whole GPU run has 8 minutes.
SIZES = {
    "tiny": {"cpu": [16, 32], "gpu": [16, 32]},
    "quick": {"cpu": [64, 128, 256, 512, 1024, 2048], "gpu": [64, 128, 256, 512, 1024, 2048]},
    "full": {"cpu": [64, 128, 256, 512, 1024, 2048, 4096, 8192], "gpu": [64, 128, 256, 512, 1024, 2048, 4096, 8192]},
    "gpu": {"cpu": [64, 128, 256, 512, 1024, 2048], "gpu": [64, 128, 256, 512, 1024, 2048, 4096, 8192]},
}
PEAK_SIZE = {"tiny": 64, "quick": 2048, "full": 4096, "gpu": 8192}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def decisive_first(sizes: list[int]) -> list[int]:
    """The largest size (claim 1's comparison) and the smallest (claim 2's latency) first, then the rest: a budget
    that runs out skips from the end."""
    ordered = sorted(sizes)
    return [ordered[-1], *ordered[:-1]] if len(ordered) > 1 else ordered


def _product(dtype):
    if dtype == jnp.float32:
        return jax.jit(lambda a, b: jnp.matmul(a, b, precision=lax.Precision.HIGHEST))
    return jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Times n x n products in fp32 and bf16->fp32 on each backend, plus each backend's bf16 peak."""
    budget = budget or common.Budget(None)
    repeats = 3 if size == "tiny" else 5
    rows, peaks = [], {}
    sizes = {b: common.preset(SIZES, size)["cpu" if b == "cpu" else "gpu"] for b in common.backends_present()}
    for n, backend in common.interleaved(sizes, decisive_first):
        device = common.first_device(backend)
        for dname, dtype in DTYPES.items():
            if budget.over(0.85):
                budget.skip(f"{backend} {dname} n={n}")
                continue
            key_a, key_b = jax.random.split(jax.random.key(n))
            a = jax.device_put(jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype), device)
            b = jax.device_put(jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype), device)
            product = _product(dtype)
            timing = time_fn(lambda: product(a, b), repeats=repeats)
            rows.append(
                {
                    "backend": backend,
                    "dtype": dname,
                    "n": n,
                    **timing.as_dict(),
                    "gflops": matmul_flops(n, n, n) / timing.median / 1e9,
                }
            )
    for backend in common.backends_present():
        peak_n = PEAK_SIZE[size] if backend != "cpu" or size != "gpu" else 2048
        if budget.over(0.95):
            budget.skip(f"{backend} peak")
            continue
        peaks[backend] = measure_matmul_peak(peak_n, jnp.bfloat16, common.first_device(backend), repeats=repeats)
    order = {b: i for i, b in enumerate(common.backends_present())}
    return {
        "rows": sorted(rows, key=lambda r: (order[r["backend"]], r["n"], r["dtype"] != "f32")),
        "peaks": peaks,
        "device_kinds": {b: common.first_device(b).device_kind for b in common.backends_present()},
    }


def summary(record: dict) -> dict:
    """The figures the report decides claims 1 and 2 with; crossovers need two backends in one record."""
    rows = record["rows"]
    by = {(r["backend"], r["dtype"], r["n"]): r for r in rows}
    out = {"best_gflops": {}, "peak_gflops": {b: p["gflops"] for b, p in record.get("peaks", {}).items()}}
    for r in rows:
        key = f"{r['backend']}/{r['dtype']}"
        if r["gflops"] > out["best_gflops"].get(key, (0, 0))[0]:
            out["best_gflops"][key] = (r["gflops"], r["n"])
    out["bf16_ceiling"] = bf16_ceilings(record)
    accel = [b for b in {r["backend"] for r in rows} if b != "cpu"]
    if accel and any(r["backend"] == "cpu" for r in rows):
        acc = accel[0]
        sizes = sorted(
            {r["n"] for r in rows if r["backend"] == acc and r["dtype"] == "f32" and ("cpu", "f32", r["n"]) in by}
        )
        faster = [n for n in sizes if by[(acc, "f32", n)]["median"] < by[("cpu", "f32", n)]["median"]]
        cpu_wins = [n for n in sizes if n not in faster]
        out["accelerator"] = acc
        out["overtake_n"] = next((n for n in sizes if all(m in faster for m in sizes if m >= n)), None)
        out["cpu_faster_sizes"] = cpu_wins
        out["latency_us"] = {
            n: {"cpu": by[("cpu", "f32", n)]["median"] * 1e6, acc: by[(acc, "f32", n)]["median"] * 1e6} for n in sizes
        }
        largest = max(sizes) if sizes else None
        if largest:
            out["largest_n"] = largest
            out["speedup_at_largest"] = by[("cpu", "f32", largest)]["median"] / by[(acc, "f32", largest)]["median"]
    return out


def bf16_ceilings(record: dict) -> dict[str, Ceiling]:
    """{backend: the bf16 ceiling}: its peak measurement, or its fastest bf16 product of the sweep where one beat
    it (the peak is one size's fastest window; on a shared machine another size can outrun it)."""
    peaks = record.get("peaks", {})
    out = {}
    for backend in {r["backend"] for r in record["rows"]} | set(peaks):
        rows = [r for r in record["rows"] if r["backend"] == backend and r["dtype"] == "bf16"]
        found = ceiling(
            (peaks.get(backend) or {}).get("gflops"), [(f"the n={r['n']} product", r["gflops"]) for r in rows]
        )
        if found is not None:
            out[backend] = found
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in sorted({r["backend"] for r in record["rows"]}):
        for dtype, style in (("f32", "-o"), ("bf16", "--s")):
            rows = sorted(
                (r for r in record["rows"] if r["backend"] == backend and r["dtype"] == dtype), key=lambda r: r["n"]
            )
            if rows:
                (line,) = ax.plot(
                    [r["n"] for r in rows], [r["gflops"] for r in rows], style, label=f"{backend} {dtype}"
                )
                # The spread: the IQR of per-call time, drawn as a band of GFLOP/s.
                ax.fill_between(
                    [r["n"] for r in rows],
                    [2 * r["n"] ** 3 / r["p75"] / 1e9 for r in rows],
                    [2 * r["n"] ** 3 / r["p25"] / 1e9 for r in rows],
                    color=line.get_color(),
                    alpha=0.2,
                )
        top = bf16_ceilings(record).get(backend)
        if top is not None:
            where = top.raised_by or f"n={record['peaks'][backend]['size']}"
            ax.axhline(top.gflops, ls=":", lw=1, color="gray", label=f"{backend} bf16 peak ({where})")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="n (n x n x n product)",
        ylabel="GFLOP/s",
        title=f"Matrix product throughput — {record['machine']['tag']}",
    )
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    s = summary(record)
    lines = [f"best {k}: {v[0]:.1f} GFLOP/s at n={v[1]}" for k, v in s["best_gflops"].items()]
    lines += [f"{b} bf16 peak: {c.gflops:.1f} GFLOP/s {c.note}".rstrip() for b, c in s["bf16_ceiling"].items()]
    if "overtake_n" in s:
        lines.append(
            f"{s['accelerator']} overtakes the CPU from n={s['overtake_n']}; CPU faster at {s['cpu_faster_sizes']}"
        )
    return lines


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
