"""The parts of REPORT.md a reader takes in first: the summary table (each claim's verdict on each machine, with the
figure that decides it, and the projected verdict), the machines' labels (the reader's own first, the committed
ones said to be so) and each section's verdict as one sentence per machine, with what every machine shares said
once."""

from __future__ import annotations

import re

NOT_MEASURED = "not measured"

# Per claim, the table rows whose figure a summary cell shows, first measured one wins, with the short name the
# cell gives it. A machine with none of them shows its verdict alone.
HEADLINES: dict[int, list[tuple[str, str]]] = {
    1: [("accelerator / host CPU, largest fp32", "GPU/CPU fp32"), ("best fp32 (exact)", "best fp32")],
    2: [
        ("GPU: chain time / equal-FLOP parallel product", "GPU chain/parallel"),
        ("CPU: µs per dependent step (chain)", "CPU dependent step"),
    ],
    3: [("exp_matmul, largest n: fp32 / bf16->fp32", "fp32 / bf16")],
    4: [("gpu-check: bf16 GEMM on bf16 operands", "bf16 GEMM on bf16"), ("bf16 matmul kernels", "bf16 kernels")],
    5: [
        (
            "crop+flip on the host: images/s per core (steps/s it keeps up with per core)",
            "host crop+flip img/s per core",
        ),
        ("input-wait fraction: host / in the step", "input wait host / step"),
    ],
    6: [],  # its verdict's sentence is the figure: samples/s from the smallest to the largest batch
    7: [("gpu cnn: batch-1 p50 / p99", "GPU CNN batch-1"), ("cpu cnn: batch-1 p50 / p99", "CPU CNN batch-1")],
}


def anchor(number: int, title: str) -> str:
    """The GitHub anchor of "## Claim N: Title"."""
    text = f"claim {number}: {title}".lower()
    return "#" + re.sub(r"[^a-z0-9 _-]", "", text).replace(" ", "-")


def label(tag: str, this: str | None) -> str:
    """How the report names a machine: the reader's own, or results committed from another machine."""
    return f"`{tag}` (this machine)" if tag == this else f"`{tag}` (committed)"


def ordered(tags: list[str], this: str | None) -> list[str]:
    """The reader's machine first, the rest in their order."""
    return [t for t in tags if t == this] + [t for t in tags if t != this]


def headline(number: int, tag: str, cells: dict[str, dict[str, str]], verdict: tuple[str, str]) -> str:
    """A summary cell: the machine's verdict and the first measured figure of the claim's headline rows."""
    for row, short in HEADLINES.get(number, []):
        value = cells.get(row, {}).get(tag)
        if value and value != NOT_MEASURED and not value.startswith("failed"):
            return f"{verdict[0]}: {short} {value}"
    if verdict[0] != NOT_MEASURED:  # the verdict's own first figure
        first = verdict[1].split(";")[0].strip()
        return f"{verdict[0]}: {first if len(first) <= 90 else first[:87] + '...'}"
    return verdict[0] if verdict[0] != NOT_MEASURED else f"{NOT_MEASURED} ({_why(verdict[1])})"


def _why(reason: str) -> str:
    """The few words that say why a machine has no verdict."""
    if "GPU" in reason or "accelerator" in reason:
        return "CPU only"
    return reason.split(";")[0][:60] if reason else "no results"


def verdict_lines(verdict: str, verdicts: dict[str, tuple[str, str]], this: str | None) -> list[str]:
    """The section's verdict: one line for the claim, then one sentence per machine (the reader's first); a clause
    that several machines' reasons share is said once, naming them, instead of once per machine."""
    tags = ordered(list(verdicts), this)
    clauses = {t: _unique([c.strip() for c in verdicts[t][1].split(";") if c.strip()]) for t in tags}
    shared = _unique([c for t in tags for c in clauses[t] if sum(c in clauses[u] for u in tags) > 1])
    lines = [f"**Verdict: {verdict}.**", ""]
    for t in tags:
        text = "; ".join(c for c in clauses[t] if c not in shared)
        said = f" {text[0].upper() + text[1:]}." if text else ""
        lines.append(f"- {label(t, this)}: {verdicts[t][0]}.{said}")
    for clause in shared:
        having = [t for t in tags if clause in clauses[t]]
        who = "Every machine" if len(having) == len(tags) else ", ".join(f"`{t}`" for t in having)
        lines.append(f"- {who}: {clause}.")
    return lines


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def summary_table(
    rows: list[tuple], tags: list[str], this: str | None, projected: bool, no_gpu: bool = False
) -> list[str]:
    """`rows`: (number, title, verdict, {tag: cell}, projected verdict or None). One line per claim: the overall
    verdict, each machine's with its deciding figure (a "GPU" column reads not measured when no GPU ran), the
    projected verdict."""
    gpu = ["GPU"] if no_gpu else []
    head = ["claim", "verdict", *(label(t, this) for t in tags), *gpu] + (["projected verdict"] if projected else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for number, title, verdict, cells, guessed in rows:
        row = [f"{number}. [{title}]({anchor(number, title)})", verdict, *(cells[t] for t in tags)]
        row += [f"{NOT_MEASURED} (no GPU run yet)"] if no_gpu else []
        if projected:
            row.append(f"projected: {guessed}" if guessed else "not projected")
        lines.append("| " + " | ".join(row) + " |")
    return lines


# What each matrix unit does to a bf16 product, in the words the machines table and its note use.
_UNITS = [
    ("amx_bf16", "AMX", "multiplies bf16 tiles in a matrix unit"),
    ("avx512_bf16", "AVX512-BF16", "has bf16 dot-product instructions in its vector unit"),
    ("avx512f", "AVX-512", "converts bf16 to fp32 in 512-bit vectors"),
    ("avx2", "AVX2", "converts bf16 to fp32 in 256-bit vectors"),
]


def matrix_units(info: dict) -> str:
    """The CPU's best unit for products (AMX, AVX512-BF16, AVX-512, AVX2), or the accelerator's kind."""
    if info.get("backend", "cpu") != "cpu":
        return str(info.get("device_kind", "?"))
    flags = set(info.get("cpu_flags", []))
    return next((name for flag, name, _ in _UNITS if flag in flags), "none listed")


def differences(cpu_tags: list[str], results: dict, cells: dict[str, dict[str, str]]) -> list[str]:
    """One note on what tells the CPU machines apart, with the figures it explains; nothing for a single one."""
    if len(cpu_tags) < 2:
        return []
    parts = []
    for tag in cpu_tags:
        info = next(r["machine"] for r in results[tag].values() if "machine" in r)
        flags = set(info.get("cpu_flags", []))
        what = next((f"{name} ({does})" for flag, name, does in _UNITS if flag in flags), "no vector unit listed")
        bf16 = cells.get("measured bf16 peak", {}).get(tag, NOT_MEASURED)
        fp32 = cells.get("best fp32 (exact)", {}).get(tag, NOT_MEASURED)
        parts.append(f"`{tag}`: {info.get('cpu_cores', '?')} cores, {what}; bf16 peak {bf16}, best fp32 {fp32}")
    return [
        "What differs between the machines: the unit that runs a bf16 product decides how far bf16 beats fp32 "
        "(a matrix unit by several times, vector instructions barely or not at all); fp32 follows the vector "
        "width, the clock and the cores. " + "; ".join(parts) + "."
    ]
