"""`make report`: REPORT.md from every results/<machine-tag>/ folder present, one section per claim.

Each section has the claim, a table with the CPU and GPU figures side by side (a backend with no results file shows
'not measured', never a number), the plots, and a verdict (confirmed / refuted / depends / not measured) decided by
the rules written next to each verdict function (`experiments.verdicts`) from the figures in the table. Every number
is read from a results file; the only numbers in this file are the vendor's datasheet figures quoted in claim 3's
correction.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from pathlib import Path

from experiments import (
    exp_inference,
    exp_matmul,
    exp_parallel,
    exp_pipeline,
    exp_precision,
    exp_sequential,
    exp_train,
    glance,
    projected,
)
from experiments import projected_report as pr
from experiments.common import load_results
from experiments.verdicts import (
    LOOKUP_ERRORS,
    NOT_MEASURED,
    guard,
    is_gpu,
    overall,
    verdict_batches,
    verdict_inference,
    verdict_latency,
    verdict_libraries,
    verdict_matmul,
    verdict_pipeline,
    verdict_tensor_cores,
)

# NVIDIA datasheet figures (dense TFLOP/s), quoted, not measured: the corrected version of the article's "12x".
SPEC = {
    "V100 tensor fp16": 125.0,
    "V100 fp32": 15.7,
    "P100 fp32": 10.6,
    "H200 bf16 dense": 989.0,
    "H200 fp32": 67.0,
}

CLAIMS = {
    1: (
        "Parallel matrix work",
        "Neural networks are mostly matrix products, which are embarrassingly parallel; a GPU "
        "with thousands of cores and far higher memory bandwidth computes them much faster than a CPU.",
    ),
    2: (
        "Latency",
        "Work that cannot be split into parallel pieces (sequential, dependent steps) runs faster on the "
        "CPU, whose cores have lower latency.",
    ),
    3: (
        "Tensor cores",
        "Since Volta, GPUs carry matrix units (tensor cores) with NVIDIA's '12x the throughput' of "
        "ordinary CUDA cores; CPUs have matrix units too (Intel AMX).",
    ),
    4: (
        "Libraries",
        "CUDA made general GPU computing possible and cuDNN gave networks ready primitives; in jaxnn XLA "
        "emits these library calls.",
    ),
    5: (
        "Split the work",
        "Only compute-heavy parallel code should go to the GPU; data preprocessing belongs on the "
        "CPU, or the GPU becomes a bottleneck.",
    ),
    6: ("Big data, big batches", "The GPU pays off when training on large data in chunks (batches)."),
    7: (
        "Inference",
        "For batched inference the GPU helps; for one-at-a-time real-time inference it may bring no gain.",
    ),
}


# ------------------------------------------------------------------------------------------------ helpers


def _fmt(x, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return NOT_MEASURED
    if isinstance(x, str):
        return x
    if abs(x) >= 100:
        s = f"{x:,.0f}"
    elif abs(x) >= 1:
        s = f"{x:.{max(digits - 1, 1)}g}" if abs(x) < 10 else f"{x:.1f}"
    else:
        s = f"{x:.{digits}g}"
    return f"{s}{unit}"


def _ratio(x) -> str:
    return NOT_MEASURED if x is None else f"{x:.2f}x"


class Machines:
    """The results by machine tag; columns of the tables are the CPU tags, then the GPU tags (or one 'GPU' column
    reading 'not measured' when no GPU results exist)."""

    def __init__(self, results: dict[str, dict[str, dict]], costs: dict | None = None, this: str | None = None):
        self.results, self.this = results, this
        self.cpu = glance.ordered(sorted(t for t in results if not is_gpu(t)), this)
        self.gpu = glance.ordered(sorted(t for t in results if is_gpu(t)), this)
        self.cells: dict[str, dict[str, str]] = {}  # every table's cells by row label and machine, for the summary
        # The projected column (when results/projected/ holds program costs): always the last, apart from the rest.
        self.projection = pr.Projection(costs, self.cpu, self.gpu, self.get) if costs else None

    def columns(self) -> list[str | None]:
        return (self.cpu or [None]) + (self.gpu or [None])

    def header(self) -> list[str]:
        mark = lambda t: " (this machine)" if t == self.this else ""  # noqa: E731
        cpu = [f"CPU `{t}`{mark(t)}" for t in self.cpu] or [f"CPU ({NOT_MEASURED})"]
        gpu = [f"GPU `{t}`{mark(t)}" for t in self.gpu] or [f"GPU ({NOT_MEASURED})"]
        return cpu + gpu

    def get(self, tag: str | None, name: str) -> dict | None:
        return self.results.get(tag, {}).get(name) if tag else None


def _table(machines: Machines, rows: list[tuple[str, callable]], cells: Callable | None = None) -> str:
    """`rows`: (label, fn(tag, machines) -> str or None); None shows as 'not measured'. `cells(projection)`: the
    projected column's {label: fn() -> str}; a row without one, or whose figures are missing, reads 'not
    projected'."""
    proj = machines.projection
    projected = guard(cells, proj) if proj is not None and cells is not None else {}
    projected = projected if isinstance(projected, dict) else {}
    head = ["figure"] + machines.header() + ([proj.header()] if proj is not None else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, fn in rows:
        cells = []
        for tag in machines.columns():
            try:
                value = fn(tag) if tag else None
            # Any subset of rows may be missing (a budget, a crash, a sweep one machine lacks): a cell without its
            # figures reads 'not measured', whatever lookup found the gap.
            except LOOKUP_ERRORS:
                value = None
            cells.append(NOT_MEASURED if value is None else value)
            if tag:
                machines.cells.setdefault(label, {})[tag] = cells[-1]
        if proj is not None:
            guarded = guard(projected[label]) if label in projected else pr.NOT_PROJECTED
            cells.append(guarded if isinstance(guarded, str) else pr.NOT_PROJECTED)
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def _plots(machines: Machines, name: str, report_dir: Path, results_root: Path) -> str:
    out = []
    for tag in machines.cpu + machines.gpu:
        png = results_root / tag / f"{name}.png"
        if png.exists():
            out.append(f"![{name} on {tag}]({os.path.relpath(png, report_dir)})")
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------ sections


def _best(rec, key):
    v = exp_matmul.summary(rec)["best_gflops"].get(key)
    return f"{v[0]:,.0f} GFLOP/s (n={v[1]})" if v else None


def _ceiling_cell(top) -> str:
    """A peak no rate of its run exceeds; where one did, the cell says which (`experiments.peaks`)."""
    if top.raised_by is None:
        return _fmt(top.gflops, " GFLOP/s")
    was = "" if top.measured is None else f"; the peak measurement read {_fmt(top.measured)}"
    return f"{_fmt(top.gflops, ' GFLOP/s')} ({top.raised_by}{was})"


def section_matmul(m: Machines) -> tuple[str, dict]:
    get = lambda t: m.get(t, "exp_matmul")  # noqa: E731
    accel = lambda t: next((b for b in get(t)["peaks"] if b != "cpu"), None)  # noqa: E731
    rows = [
        ("best fp32 (exact)", lambda t: _best(get(t), f"{accel(t) or 'cpu'}/f32")),
        ("best bf16 -> fp32", lambda t: _best(get(t), f"{accel(t) or 'cpu'}/bf16")),
        ("measured bf16 peak", lambda t: _ceiling_cell(exp_matmul.summary(get(t))["bf16_ceiling"][accel(t) or "cpu"])),
        ("host CPU best fp32 (same machine)", lambda t: _best(get(t), "cpu/f32") if accel(t) else None),
        (
            "accelerator / host CPU, largest fp32",
            lambda t: _ratio(exp_matmul.summary(get(t)).get("speedup_at_largest")),
        ),
        ("accelerator overtakes the CPU from n =", lambda t: _fmt(exp_matmul.summary(get(t)).get("overtake_n"))),
    ]
    verdicts = {t: guard(verdict_matmul, get(t)) for t in m.cpu + m.gpu}
    return _table(m, rows, pr.matmul_cells), verdicts


def section_latency(m: Machines) -> tuple[str, dict]:
    seq = lambda t: m.get(t, "exp_sequential")  # noqa: E731

    def per_step(t, backend, case):
        per = exp_sequential.summary(seq(t))["per_step_us"].get(backend, {}).get(case)
        h = min(per, key=float)
        return f"{per[h]:.2f} µs (hidden {h})"

    def penalty(t, backend):
        pen = exp_sequential.summary(seq(t))["sequential_penalty"][backend]["chain"]
        h = min(pen, key=float)
        return f"{pen[h]:.1f}x"

    def lat(t, backend):
        s = exp_matmul.summary(m.get(t, "exp_matmul"))["latency_us"]
        n = min(s, key=float)
        return f"{s[n][backend]:.1f} µs (n={n})"

    rows = [
        ("CPU: µs per dependent step (chain)", lambda t: per_step(t, "cpu", "chain")),
        ("CPU: µs per dependent step (RNN)", lambda t: per_step(t, "cpu", "rnn")),
        ("CPU: chain time / equal-FLOP parallel product", lambda t: penalty(t, "cpu")),
        ("GPU: µs per dependent step (chain)", lambda t: per_step(t, "gpu", "chain")),
        ("GPU: µs per dependent step (RNN)", lambda t: per_step(t, "gpu", "rnn")),
        ("GPU: chain time / equal-FLOP parallel product", lambda t: penalty(t, "gpu")),
        ("smallest fp32 product, host CPU", lambda t: lat(t, "cpu")),
        ("smallest fp32 product, GPU", lambda t: lat(t, "gpu")),
    ]
    verdicts = {t: guard(verdict_latency, seq(t), m.get(t, "exp_matmul")) for t in m.cpu + m.gpu}
    return _table(m, rows, pr.latency_cells), verdicts


def section_precision(m: Machines) -> tuple[str, dict]:
    prec = lambda t: exp_precision.summary(m.get(t, "exp_precision"))  # noqa: E731
    train = lambda t: exp_train.summary(m.get(t, "exp_train"))  # noqa: E731
    rows = []
    for op in ("matmul", "conv"):
        for mode in ("fp32", "tf32", "bf16", "fp16", "bf16_out"):
            rows.append(
                (
                    f"{op} {mode}: GFLOP/s, speedup, rel. error",
                    lambda t, op=op, mode=mode: _precision_cell(prec(t)[op][mode], mode),
                )
            )

    def mm_pair(t):
        rec = m.get(t, "exp_matmul")
        b = next((x for x in rec["peaks"] if x != "cpu"), "cpu")
        n = max(r["n"] for r in rec["rows"] if r["backend"] == b)
        g = {r["dtype"]: r["gflops"] for r in rec["rows"] if r["backend"] == b and r["n"] == n}
        return f"{g['f32']:,.0f} / {g['bf16']:,.0f} GFLOP/s ({g['bf16'] / g['f32']:.2f}x, n={n})"

    rows.append(("exp_matmul, largest n: fp32 / bf16->fp32", mm_pair))

    def trained(t, model, p):
        rec = m.get(t, "exp_train")
        if rec is None:
            return None
        failed = [f for f in rec.get("failures", []) if (f["model"], f["precision"]) == (model, p)]
        if failed:
            return f"failed: {failed[0]['error'][:80]}"
        s = train(t)[model]
        return f"{s[p]['speedup']:.2f}x; {s[p]['quality']:.3f} ({s['fp32']['quality']:.3f})"

    for model in ("cnn", "gpt"):
        for p in ("bf16", "fp16", "tf32"):
            rows.append(
                (f"train {model} {p}: step speedup, quality (fp32's)", lambda t, model=model, p=p: trained(t, model, p))
            )
    verdicts = {t: guard(verdict_tensor_cores, m.get(t, "exp_precision")) for t in m.cpu + m.gpu}
    return _table(m, rows, pr.precision_cells), verdicts


def _precision_cell(v: dict, mode: str) -> str:
    """GFLOP/s; speedup over exact fp32 (fp32 is the baseline itself, not a 1.00x); relative error."""
    speedup = "baseline" if mode == "fp32" else f"{v['speedup']:.2f}x"
    return f"{v['gflops']:,.0f}; {speedup}; {v['rel_error']:.1e}"


def section_libraries(m: Machines) -> tuple[str, dict]:
    prec = lambda t: exp_precision.summary(m.get(t, "exp_precision"))  # noqa: E731
    chk = lambda t: m.get(t, "gpu_check")  # noqa: E731

    def kernels(t, op, mode):
        return ", ".join(f"`{k}`" for k in prec(t)[op][mode]["kernels"]) or "XLA's own code"

    rows = [
        ("bf16 matmul kernels", lambda t: kernels(t, "matmul", "bf16")),
        ("fp32 matmul kernels", lambda t: kernels(t, "matmul", "fp32")),
        ("bf16 conv kernels", lambda t: kernels(t, "conv", "bf16")),
        ("gpu-check: bf16 GEMM on bf16 operands", lambda t: None if chk(t)["dry_run"] else _gemm_check(chk(t))),
        ("gpu-check: cuDNN convolution", lambda t: None if chk(t)["dry_run"] else _conv_check(chk(t))),
    ]
    verdicts = {t: guard(verdict_libraries, chk(t), m.get(t, "exp_precision")) for t in m.cpu + m.gpu}
    return _table(m, rows, lambda p: {}), verdicts


def _gemm_check(record: dict) -> str:
    """gpu-check's tensor-core check in words: the GEMM kernel and the rate its bf16 product reached."""
    check = record["check"]
    kernels = ", ".join(sorted({f"`{c['target']}`" for c in check["gemm_calls"]})) or "no library GEMM"
    answer = "yes" if check["bf16_gemm"] else "no"
    return f"{answer} ({kernels}, {check['bf16_tflops']:,.0f} TFLOP/s at n={check['matmul_n']})"


def _conv_check(record: dict) -> str:
    check = record["check"]
    kernels = ", ".join(sorted({f"`{c['target']}`" for c in check["conv_calls"]})) or "no library call"
    answer = "yes, on bf16 operands" if check.get("bf16_conv") else ("yes" if check["cudnn_conv"] else "no")
    return f"{answer} ({kernels})"


def _costs(pipe, t, m: Machines) -> list:
    try:
        return list(pipe(t)) if m.get(t, "exp_pipeline") else []
    except LOOKUP_ERRORS:
        return []


def section_pipeline(m: Machines) -> tuple[str, dict]:
    pipe = lambda t: exp_pipeline.summary(m.get(t, "exp_pipeline"))  # noqa: E731
    rows = []
    costs = sorted({int(c) for t in m.cpu + m.gpu for c in _costs(pipe, t, m)})
    for cost in costs:
        for arr in ("sync", "overlapped", "device"):
            rows.append(
                (
                    f"cost {cost}, {arr}: samples/s (device idle)",
                    lambda t, c=cost, a=arr: (lambda v: f"{v['samples_per_s']:,.0f} ({v['device_idle']:.0%})")(
                        {int(k): x for k, x in pipe(t).items()}[c][a]
                    ),
                )
            )
    split = lambda t: (m.get(t, "exp_pipeline") or {}).get("split") or {}  # noqa: E731

    def measured(fn):
        return lambda t: fn(split(t)) if "in_step" in split(t) else None

    rows += [
        (
            "crop+flip on the host: images/s per core (steps/s it keeps up with per core)",
            lambda t: (
                f"{split(t)['host_images_per_s_per_core']:,.0f} "
                f"({split(t)['host_keeps_up_to_steps_per_s_per_core']:,.0f})"
                if split(t)
                else None
            ),
        ),
        (
            "crop+flip in the step: extra device time per step",
            measured(lambda v: f"{v['device_extra_s'] * 1e3:+.2f} ms ({v['device_extra_fraction']:+.0%})"),
        ),
        (
            "input-wait fraction: host / in the step",
            measured(lambda v: f"{v['host']['input_wait_fraction']:.0%} / {v['in_step']['input_wait_fraction']:.0%}"),
        ),
        (
            "steps/s: host / in the step",
            measured(lambda v: f"{v['host']['steps_per_s']:,.1f} / {v['in_step']['steps_per_s']:,.1f}"),
        ),
        (
            pr.SPLIT_RATE_LABEL,
            measured(lambda v: f"{1 / v['step_plain_s']:,.0f} steps/s, {v['host_batch_s'] / v['step_plain_s']:,.2f}"),
        ),
    ]
    verdicts = {t: guard(verdict_pipeline, m.get(t, "exp_pipeline")) for t in m.cpu + m.gpu}
    return _table(m, rows, lambda p: pr.pipeline_cells(p, costs)), verdicts


def section_batches(m: Machines) -> tuple[str, dict]:
    par = lambda t: m.get(t, "exp_parallel")  # noqa: E731
    rows = []
    batches = sorted({r["global_batch"] for t in m.cpu + m.gpu if par(t) for r in par(t).get("sweep", [])})
    for b in batches:
        rows.append(
            (
                f"train samples/s, batch {b} (1 device)",
                lambda t, b=b: _fmt(
                    next((r["samples_per_s"] for r in par(t)["sweep"] if r["global_batch"] == b), None)
                ),
            )
        )
    for form in ("jit", "shard_map", "pmap"):
        rows.append((f"{form}: speedup from 1 to N devices", lambda t, f=form: _scaling_cell(par(t), f)))
    rows.append(("devices simulated on the CPU", lambda t: str(par(t)["simulated_devices"])))
    verdicts = {t: guard(verdict_batches, par(t)) for t in m.cpu + m.gpu}
    return _table(m, rows, lambda p: pr.batch_cells(p, batches)), verdicts


def _scaling_cell(record: dict, form: str) -> str | None:
    """ "1.93x (N=8)"; a form measured on one device count only says so, never "1.00x (N=1)"."""
    v = exp_parallel.summary(record)["scaling"].get(form)
    if v is not None:
        return f"{v['speedup']:.2f}x (N={v['devices']})"
    counts = sorted({r["devices"] for r in record["rows"] if r["form"] == form})
    return f"{NOT_MEASURED} (ran on {counts[0]} device{'s' * (counts[0] > 1)} only)" if counts else None


def section_inference(m: Machines) -> tuple[str, dict]:
    inf = lambda t: exp_inference.summary(m.get(t, "exp_inference"))  # noqa: E731
    rows = []
    for backend in ("cpu", "gpu"):
        for model in ("cnn", "gpt"):
            rows.append(
                (
                    f"{backend} {model}: batch-1 p50 / p99",
                    lambda t, b=backend, mo=model: (
                        lambda v: f"{v['batch1_p50_ms']:.2f} / {v['batch1_p99_ms']:.2f} ms"
                    )(inf(t)[b][mo]),
                )
            )
            rows.append(
                (
                    f"{backend} {model}: best samples/s (batch)",
                    lambda t, b=backend, mo=model: (lambda v: f"{v['best_samples_per_s']:,.0f} ({v['best_batch']})")(
                        inf(t)[b][mo]
                    ),
                )
            )
    verdicts = {t: guard(verdict_inference, m.get(t, "exp_inference")) for t in m.cpu + m.gpu}
    return _table(m, rows, pr.inference_cells), verdicts


CORRECTION = (
    "**Correction to the article's figure.** NVIDIA's \"12x\" compares V100 tensor cores with the previous "
    "generation's (P100) fp32 cores: {v100tc:.0f} vs {p100:.1f} TFLOP/s is {r1:.0f}x; against V100's own fp32 cores "
    "({v100:.1f}) it is about {r2:.0f}x. On an H200 the datasheet ratio of dense bf16 to fp32 is {h200bf:.0f} vs "
    "{h200fp:.0f} TFLOP/s, about {r3:.0f}x. (Datasheet figures, quoted, not measured; the measured ratios are in the "
    "table.)"
)


def build(results_root: str | Path, report_path: str | Path, this: str | None = "auto") -> str:
    """Builds the report's Markdown from `results_root` and writes it to `report_path`; returns the text. `this`:
    the reader's machine tag, marked and listed first ("auto": the machine running this)."""
    results_root, report_path = Path(results_root), Path(report_path)
    if this == "auto":
        from experiments.common import machine_tag

        this = machine_tag()
    m = Machines(load_results(results_root), projected.load(results_root), this)
    report_dir = report_path.parent.resolve()
    root = results_root.resolve()
    body, summary_rows = [], []
    for number, fn, plots in SECTIONS:
        title, claim = CLAIMS[number]
        table, verdicts = fn(m)
        verdict = overall(verdicts)[0]
        guessed = guard(pr.verdict, m.projection, number) if m.projection else None
        cells = {t: glance.headline(number, t, m.cells, verdicts[t]) for t in m.cpu + m.gpu}
        summary_rows.append((number, title, verdict, cells, guessed[0] if guessed else None))
        body += ["", f"## Claim {number}: {title}", "", f"> {claim}", ""]
        for name in plots:  # the plots carry the argument: first, then the table of figures
            pics = _plots(m, name, report_dir, root)
            if pics:
                body += [pics, ""]
        body += [table, ""]
        if number == 3:
            body += [_correction(), ""]
        body += glance.verdict_lines(verdict, verdicts, m.this) if verdicts else [f"**Verdict: {verdict}.**"]
        body.append("")
        if guessed:
            # Its own line, after the measured verdict, never in its place.
            body += [f"**Projected verdict ({pr.LABEL}): projected: {guessed[0]}.** {guessed[1]}", ""]
    from experiments.roofline import section as roofline_section

    body += roofline_section(m.results, report_dir, root)
    head = _head(m)  # after the sections: its note quotes figures their tables collected
    glance_lines = glance.summary_table(summary_rows, m.cpu + m.gpu, m.this, m.projection is not None, not m.gpu)
    out = [*head[:4], "## At a glance", "", *glance_lines, "", *(_projection_note(m) if m.projection else [])]
    text = "\n".join([*out, *head[4:], *body]).rstrip() + "\n"
    report_path.write_text(text)
    return text


SECTIONS = [
    (1, section_matmul, ["exp_matmul"]),
    (2, section_latency, ["exp_sequential"]),
    (3, section_precision, ["exp_precision", "exp_train"]),
    (4, section_libraries, []),
    (5, section_pipeline, ["exp_pipeline"]),
    (6, section_batches, ["exp_parallel"]),
    (7, section_inference, ["exp_inference"]),
]


def _correction() -> str:
    s = SPEC
    return CORRECTION.format(
        v100tc=s["V100 tensor fp16"],
        p100=s["P100 fp32"],
        v100=s["V100 fp32"],
        r1=s["V100 tensor fp16"] / s["P100 fp32"],
        r2=s["V100 tensor fp16"] / s["V100 fp32"],
        h200bf=s["H200 bf16 dense"],
        h200fp=s["H200 fp32"],
        r3=s["H200 bf16 dense"] / s["H200 fp32"],
    )


def _head(m: Machines) -> list[str]:
    """The title and introduction (the first two lines), then the machines table and what tells them apart."""
    out = [
        "# What a GPU does for deep learning — measured",
        "",
        "Generated by `make report` from the results files under `results/` "
        f"({datetime.date.today().isoformat()}). No figure below is typed by hand: each comes from a results "
        "file, and a backend without one reads *not measured*. The claims, and the experiment measuring each: "
        "docs/claims.md. How to read this report, and how each verdict is decided: docs/experiments.md "
        "and the verdict functions in experiments/report.py. The machines are shared: the load column gives the "
        "1-minute load average as the runs ended, and ratios measured in one run are more telling than absolute "
        "figures.",
        "",
        "## Machines",
        "",
        "| tag | whose results | device | CPU | matrix units | cores | jax | results date | size | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tag in m.cpu + m.gpu:
        recs = [r for r in m.results[tag].values() if "machine" in r]
        info = recs[0]["machine"]
        dates = sorted(r.get("date", "")[:10] for r in recs)
        sizes = sorted({r.get("size", "?") for r in recs})
        loads = sorted(r["machine"]["load_avg_1m"] for r in recs if r["machine"].get("load_avg_1m") is not None)
        load = f"{loads[0]:.1f}..{loads[-1]:.1f}" if loads else "?"
        whose = "this machine" if tag == m.this else "committed, from another machine"
        out.append(
            f"| `{tag}` | {whose} | {info['device_kind']} | {info.get('cpu_model', '?')} | "
            f"{glance.matrix_units(info)} | {info.get('cpu_cores', '?')} | {info['jax_version']} | "
            f"{dates[0]}..{dates[-1]} | {', '.join(sizes)} | {load} |"
        )
    out += ["", *glance.differences(m.cpu, m.results, m.cells)]
    if m.this is not None and m.this not in m.results:
        out += ["", f"This machine (`{m.this}`) has no results here yet: `make experiments` adds them beside these."]
    if not m.gpu:
        out += [
            "",
            f"No GPU results yet: every GPU column reads *{NOT_MEASURED}*. `make gpu-check` on a GPU "
            "machine writes them (results/gpu-*/).",
        ]
    return out


def _lowered_for(costs: dict) -> str:
    """Where the programs were lowered for a GPU (the layers' GPU lowering, compiled by the CPU's compiler)."""
    platform = costs.get("lowered_for")
    return f"lowered for `{platform}` (each layer as a GPU runs it) and " if platform else ""


def _projection_note(m: Machines) -> list[str]:
    p = m.projection
    return [
        f"The last column of each table and each *projected verdict* are {pr.LABEL}: an H200 modelled "
        f"(`jaxnn.profile.projection.GpuModel`) from the FLOPs, bytes and kernels of the programs measured here, "
        f"{_lowered_for(p.costs)}compiled on `{p.costs.get('compiled_on')}` ({p.costs.get('date', '')[:10]}, "
        "`make project-gpu`), set "
        f"against the measured CPU figures of `{p.cpu}`. Where a GPU run measured the same figure, the cell gives "
        "measured/projected: the model's error. The model's parameters and their sources:",
        "",
        *p.sources(),
        "",
        *_refit_note(p),
    ]


def _refit_note(p: pr.Projection) -> list[str]:
    """The model's parameters refit from the measured GPU run (`projected_report.refit`), when there is one."""
    fitted = pr.refit(p)
    if fitted is None:
        return []
    notes = fitted[1] or ["- nothing to refit: the GPU run has no exp_matmul or exp_sequential rows"]
    return [f"Refit from the measured run `{p.gpu}` (what the model's error says to change):", "", *notes, ""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__)
    parser.add_argument("--results", default="results", help="folder holding one subfolder per machine tag")
    parser.add_argument("--out", default="REPORT.md")
    args = parser.parse_args(argv)
    if not Path(args.results).is_dir():
        raise SystemExit(f"report: no results folder {args.results!r}; run `make experiments` first")
    build(args.results, args.out)
    print(f"report: wrote {args.out} from {args.results}/")


if __name__ == "__main__":
    main()
