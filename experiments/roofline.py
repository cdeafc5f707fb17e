"""Where the time goes: the per-layer roofline of the CNN and the GPT (`jaxnn.profile`), fp32 and bf16, measured on
this machine, with each layer's projected lower bound on an accelerator.

Writes results/<machine-tag>/roofline_<model>.json, roofline_<model>.png (the roofline) and roofline_<model>_time.png
(time per layer). The accelerator's peaks are the measured ones of a GPU run when results/gpu-*/ holds one (its
`make gpu-check` matmul peaks; a roofline run there also gives its bandwidth), else the H200 defaults of
`jaxnn.profile.projection`, labelled as such. `section()` is the part of REPORT.md built from these files.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from experiments import common
from experiments.peaks import Ceiling, ceiling
from jaxnn.cli.profile import IMAGE_SHAPE  # the input `jaxnn profile` and `jaxnn train` use by default
from jaxnn.models.factory import train_default_model
from jaxnn.precision import get_policy
from jaxnn.profile import measure_peaks, profile_layers
from jaxnn.profile.plots import roofline_png, time_png
from jaxnn.profile.projection import H200_SOURCE, Accelerator, accelerator

MODELS = ("cnn", "gpt")
POLICIES = ("fp32", "bf16")
WHOLE = "whole model"  # the name jaxnn.profile gives the whole model's rows
# Per preset: (size of the models, batch size per model, matmul size, copy MiB, timing windows). "quick" is what
# `jaxnn profile` does by default: `jaxnn train`'s models, batch sizes and input (the 8x8 digits).
PRESETS = {
    "tiny": ("small", {"cnn": 4, "gpt": 2}, 128, 8, 1),
    "quick": ("base", {"cnn": 64, "gpt": 32}, 2048, 256, 5),
    "gpu": ("base", {"cnn": 256, "gpt": 64}, 8192, 1024, 5),
}


def projected_accelerator(results_root: str | Path) -> Accelerator:
    """The accelerator to project onto: a GPU run's measured peaks when results/gpu-*/ has them, else the defaults."""
    root = Path(results_root)
    for tag, records in sorted(common.load_results(root).items()) if root.is_dir() else []:
        if not tag.startswith("gpu"):
            continue
        mm = records.get("exp_matmul", {})
        bf16 = mm.get("peaks", {}).get("gpu", {}).get("gflops")
        fp32 = max(
            (r["gflops"] for r in mm.get("rows", []) if r["backend"] == "gpu" and r["dtype"] == "f32"), default=None
        )
        prof = next((r for n, r in records.items() if n.startswith("roofline_")), None)
        bandwidth = prof["peaks"]["bandwidth"] / 1e12 if prof else None
        if bf16 or bandwidth:
            date = (mm or prof or {}).get("date", "")[:10]
            parts = [f"measured in results/{tag}/ ({date})"]
            if not bandwidth:
                parts.append("bandwidth: 4.3 TB/s default, not measured")
            return accelerator(
                tag,
                bf16_tflops=bf16 / 1e3 if bf16 else None,
                fp32_tflops=fp32 / 1e3 if fp32 else None,
                bandwidth_tbs=bandwidth,
                source="; ".join(parts),
            )
    return accelerator("H200", source=H200_SOURCE)


def run(size: str, out: str | Path) -> list[Path]:
    """Profiles both models in both policies; returns the files written."""
    model_size, batches, matmul_size, copy_mib, repeats = common.preset(PRESETS, size)
    peaks = measure_peaks([get_policy(p).compute_dtype for p in POLICIES], matmul_size=matmul_size, copy_mib=copy_mib)
    accel = projected_accelerator(out)
    written = []
    for name in MODELS:
        model, mcfg = train_default_model(name, size=model_size)
        shape = (mcfg.seq_len,) if name == "gpt" else IMAGE_SHAPE
        budget = common.Budget(None)
        profiles = [
            profile_layers(
                model,
                shape,
                batch_size=batches[name],
                policy=p,
                peaks=peaks,
                accelerator=accel,
                repeats=repeats,
                id_range=getattr(mcfg, "vocab_size", 2),
            )
            for p in POLICIES
        ]
        figures = {"model": name, "model_size": model_size, "profiles": [p.as_dict() for p in profiles]}
        figures |= {"peaks": peaks.as_dict(), "accelerator": accel.as_dict()}
        path = common.write_results(out, f"roofline_{name}", size, figures, budget)
        written += [path, roofline_png(profiles, path.with_suffix(".png"))]
        written.append(time_png(profiles, path.with_name(f"{path.stem}_time.png")))
        for p in profiles:
            print(p)
    return written


# ------------------------------------------------------------------------------------------------ REPORT.md


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3g}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _by_layer(record: dict, pass_: str) -> dict[str, dict[str, dict]]:
    """{layer: {policy: row}} for one pass, the whole model last."""
    table: dict[str, dict[str, dict]] = {}
    for prof in record["profiles"]:
        for row in (*prof["rows"], *prof["whole"]):
            if row["pass_"] == pass_:
                table.setdefault(row["layer"], {})[prof["policy"]] = row
    return table


def ceilings(record: dict) -> dict[str, Ceiling]:
    """{policy: the matmul peak of its compute dtype, or the fastest layer of the run where one beat it}: what
    "% peak" divides by, so that no layer reads above 100% (`experiments.peaks`)."""
    out = {}
    for prof in record["profiles"]:
        rates = [
            (f"{row['layer']} ({row['pass_']})", row["flops_per_s"] / 1e9 if row.get("flops_per_s") else None)
            for row in (*prof["rows"], *prof["whole"])
        ]
        found = ceiling(prof["peaks"]["matmul_flops"].get(prof["dtype"], 0) / 1e9 or None, rates)
        if found is not None:
            out[prof["policy"]] = found
    return out


def _measured_cells(by: dict[str, dict], tops: dict[str, Ceiling]) -> list[str]:
    cells = []
    for p in POLICIES:
        r = by.get(p, {})
        rate, intensity = r.get("flops_per_s"), r.get("intensity")
        top = tops.get(p)
        fraction = rate / (top.gflops * 1e9) if rate is not None and top is not None else None
        cells += [_ms(r.get("seconds")), "-" if rate is None else f"{rate / 1e9:.3g}", _pct(fraction)]
        cells += ["-" if intensity is None else f"{intensity:.3g}", r.get("bound") or "-"]
    return cells


def _measured_table(record: dict) -> list[str]:
    head = ["layer"] + [f"{p} {c}" for p in POLICIES for c in ("ms", "GFLOP/s", "% peak", "FLOP/B", "bound")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = _by_layer(record, "forward+backward")
    whole = rows.pop(WHOLE, {})
    tops = ceilings(record)
    for layer, by in rows.items():
        lines.append("| " + " | ".join([layer, *_measured_cells(by, tops)]) + " |")
    sums = {p["policy"]: p["layer_sum_s"]["forward+backward"] for p in record["profiles"]}
    cells = [c for p in POLICIES for c in (_ms(sums.get(p)), "", "", "", "")]
    lines.append("| " + " | ".join(["**sum of the layers**", *cells]) + " |")
    lines.append("| " + " | ".join(["**whole model** (compiled as one)", *_measured_cells(whole, tops)]) + " |")
    raised = [f"{p} % peak: the peak {top.note}" for p, top in tops.items() if top.note]
    return lines + ([""] + [f"{'; '.join(raised)}."] if raised else [])


def _projected_table(record: dict, gpu: dict | None) -> list[str]:
    name = record["accelerator"]["name"]
    head = ["layer"] + [f"{p} {c}" for p in POLICIES for c in ("CPU ms (measured)", f"{name} µs (bound)", "speed-up")]
    if gpu:
        head += [f"{p} GPU ms (measured)" for p in POLICIES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    gpu_rows = _by_layer(gpu, "forward+backward") if gpu else {}
    for layer, by in _by_layer(record, "forward+backward").items():
        cells = [layer]
        for p in POLICIES:
            r = by.get(p, {})
            bound, x = r.get("projected_s"), r.get("speedup")
            cells += [
                _ms(r.get("seconds")),
                "-" if bound is None else f"{bound * 1e6:.3g}",
                "-" if x is None else f"{x:,.0f}x",
            ]
        if gpu:
            cells += [_ms(gpu_rows.get(layer, {}).get(p, {}).get("seconds")) for p in POLICIES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cache(pk: dict) -> str:
    if not pk.get("cache_bandwidth"):
        return ""
    return f"; {pk['cache_bandwidth'] / 1e9:.0f} GB/s over {pk['cache_mib']} MiB, which stay in cache"


def _model_part(name: str, tag: str, rec: dict, gpu: dict | None, report_dir: Path, root: Path) -> list[str]:
    pk, acc = rec["peaks"], rec["accelerator"]
    flops = ", ".join(f"{d} {v / 1e9:,.0f} GFLOP/s" for d, v in sorted(pk["matmul_flops"].items()))
    shape = rec["profiles"][0]["in_shape"]
    pngs = [root / tag / f"roofline_{name}.png", root / tag / f"roofline_{name}_time.png"]
    out = [
        f"### {name.upper()} on `{tag}` — measured",
        "",
        f"Input {tuple(shape)}, {pk['device']} ({rec['date'][:10]}, load {rec['machine'].get('load_avg_1m', 0):.1f}). "
        f"Measured ceilings on this CPU: matmul {flops} ({pk['matmul_size']}^3), copy {pk['bandwidth'] / 1e9:.1f} GB/s "
        f"({pk['copy_mib']} MiB){_cache(pk)}. Forward+backward per layer (forward rows are in the JSON):",
        "",
        *_measured_table(rec),
        "",
        *[f"![{p.stem} on {tag}]({os.path.relpath(p, report_dir)})" for p in pngs if p.exists()],
        "",
        f"### {name.upper()} on {acc['name']} — projected, not measured",
        "",
        f"Lower bound max(FLOPs / peak, bytes / bandwidth) per layer from the CPU program's counts, with "
        f"{', '.join(f'{d} {v / 1e12:g} TFLOP/s' for d, v in sorted(acc['peak_flops'].items()))} and "
        f"{acc['bandwidth'] / 1e12:g} TB/s ({acc['source']}). Kernel launches (microseconds each) are not in it, so "
        "small layers will run far slower than their bound; the speed-up is an upper bound.",
        "",
        *_projected_table(rec, gpu),
        "",
    ]
    return out


def section(results: dict[str, dict[str, dict]], report_dir: Path, results_root: Path) -> list[str]:
    """REPORT.md's roofline section (Markdown lines) from the roofline_* records of every machine; empty without."""
    tags = [t for t in sorted(results) if any(n.startswith("roofline_") for n in results[t])]
    if not tags:
        return []
    gpu_tags = [t for t in tags if t.startswith("gpu")]
    gpu_runs = [t for t in sorted(results) if t.startswith("gpu")]  # GPU results of any kind, roofline or not
    out = [
        "",
        "## Where the time goes: per-layer roofline",
        "",
        "Each top-level layer compiled and timed alone (`make exp-roofline`, i.e. `python -m experiments.roofline`; "
        "`jaxnn profile --model cnn|gpt` prints the same table): median time, XLA's FLOPs and bytes of the timed "
        "program, and the bound: compute when the intensity is above the ridge point (peak/bandwidth) of the "
        "memory its bytes come from (the caches' for a layer whose bytes stay there, main memory's otherwise) or "
        'the layer runs at half the matmul peak or more; memory otherwise (docs/profiling.md, "The ceilings"). '
        "Ceilings are the fastest window of three interleaved rounds of a large matmul per dtype and of a large "
        "elementwise pass; the solid bandwidth roof is main memory's, the dotted one a pass of a few MiB, which "
        "stays in cache. Images are the 8x8 digits `jaxnn train` trains on (results from before that default "
        "profiled 28x28x1: see each machine's table title). Measured figures and projections are separate tables.",
        "",
    ]
    if not gpu_runs:
        out += [
            "No GPU run yet: the accelerator columns are projections only. Once `make gpu-check` writes "
            "results/gpu-*/, its measured matmul peaks replace the defaults in later roofline runs, and a roofline "
            "run on the GPU puts its measured times next to the projections.",
            "",
        ]
    elif not gpu_tags:
        runs = ", ".join(f"`{t}`" for t in gpu_runs)
        out += [
            f"The GPU results ({runs}) hold no roofline run, so no layer has a measured GPU time here: the "
            "accelerator columns are projections, with the peaks each CPU run recorded when it ran (named under "
            "each table). `make exp-roofline` on the GPU would put measured times next to them.",
            "",
        ]
    for tag in [t for t in tags if not t.startswith("gpu")] + gpu_tags:
        for name in MODELS:
            rec = results[tag].get(f"roofline_{name}")
            if rec:
                gpu = next((results[g].get(f"roofline_{name}") for g in gpu_tags if g != tag), None)
                out += _model_part(name, tag, rec, gpu, report_dir, results_root)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.roofline", description=__doc__)
    parser.add_argument("--size", choices=common.SIZES, default="quick", help="tiny: tests; gpu: one H200")
    parser.add_argument("--out", default="results", help="results folder (a subfolder per machine tag)")
    common.add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    common.set_overwrite(args.overwrite)
    for path in run(args.size, args.out):
        print(f"roofline: wrote {path}")


if __name__ == "__main__":
    main()
