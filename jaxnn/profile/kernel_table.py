"""Where a compiled program's time goes, operation by operation: the XLA operations of a `jax.profiler` trace,
summed by name with their share of the device's busy time and a kind (matrix product, attention, convolution,
elementwise fusion, reduction, copy, collective, other).

    table = kernel_table(trace_steps(lambda: step(state, batch), steps=3, log_dir="runs/trace"))
    print(format_kernel_table(table))

or, for a trace already written (`jaxnn train --profile-dir DIR`, `fit(profile_dir=DIR)`):

    python -m jaxnn.profile.kernel_table DIR

What counts as an operation: on a GPU, the kernels on the device's streams (a cuBLAS GEMM, cuDNN's fused attention,
an XLA fusion), grouped by the XLA operation that launched them where the trace says which; on a CPU, the XLA
runtime's operations (each with its `hlo_op`). Time is self time: an operation that contains others (a CPU `while`
around a scanned layer's body) counts only what its children do not.

Why not XProf's op statistics: XProf reads the same trace into richer tables, but its package (32 MB, with a
storage and SQL stack behind it) cannot be carried to a GPU machine without a network, and this table needs only
the trace's own JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

# First match wins: attention before matrix products (cuDNN's fused attention runs GEMMs inside), GEMMs before
# convolutions (cuDNN's name is in both).
KINDS: tuple[tuple[str, re.Pattern], ...] = (
    ("attention", re.compile(r"fmha|flash|sdpa|attention|_mha", re.I)),
    ("collective", re.compile(r"all-reduce|all_reduce|all-gather|all_gather|reduce-scatter|nccl|all-to-all", re.I)),
    ("matmul", re.compile(r"gemm|cublas|xmma|cutlass|matmul|^dot\b|^dot[._]|dot_general|onednn", re.I)),
    ("convolution", re.compile(r"convolution|cudnn|\bconv\d*[._]|conv[123]d|dgrad|wgrad", re.I)),
    ("copy", re.compile(r"copy|transpose|memcpy|memset|dynamic.update.slice|concatenat", re.I)),
    ("reduction", re.compile(r"reduce|argmax|argmin", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|broadcast|select|add|multiply|convert", re.I)),
)
# An HLO computation's header line and an instruction's name, opcode and the computation a fusion calls.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Profiler bookkeeping on the CPU runtime's threads: not operations.
_RUNTIME_EVENT = re.compile(r"^(ThreadpoolListener|ThunkExecutor|end: )")


def kind_of(name: str) -> str:
    """The kind of an operation or kernel from its name (see KINDS); 'other' when none matches."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kinds_from_hlo(hlo_text: str) -> dict[str, str]:
    """The kind of each instruction of a compiled program's HLO (`compiled.as_text()`), by what it computes: a
    fusion whose body holds a dot is a matrix product whatever its name ("ynn_fusion.3", "loop_fusion"), a custom
    call by its target (cuBLAS's GEMM, cuDNN's attention)."""
    bodies: dict[str, list[str]] = {}
    calls: dict[str, str] = {}
    current: list[str] = []
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = bodies.setdefault(header.group(1), [])
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        name, opcode = instruction.groups()
        target = _TARGET.search(line)
        current.append(f"{opcode} {target.group(1) if target else ''}")
        called = _CALLS.search(line)
        if opcode == "fusion" and called:
            calls[name] = called.group(1)
        else:
            calls.setdefault(name, "")
            bodies.setdefault(f"={name}", []).append(f"{opcode} {target.group(1) if target else ''}")
    kinds = {}
    for name, body in calls.items():
        ops = bodies.get(body, []) if body else bodies.get(f"={name}", [])
        kinds[name] = _kind_of_body(ops)
    return kinds


def _kind_of_body(ops: list[str]) -> str:
    text = " ".join(ops)
    for kind, pattern in (
        ("attention", KINDS[0][1]),
        ("collective", KINDS[1][1]),
        ("matmul", re.compile(r"\bdot\b|gemm|cublas|matmul|onednn", re.I)),
        ("convolution", re.compile(r"\bconvolution\b|cudnn\$conv", re.I)),
        ("reduction", re.compile(r"\breduce\b|reduce-window")),
        ("copy", re.compile(r"^(copy|transpose|bitcast|dynamic-update-slice|concatenate|slice)\b")),
    ):
        if pattern.search(text):
            return kind
    return "fusion" if len(ops) > 1 else kind_of(text)


@dataclasses.dataclass(frozen=True)
class KernelRow:
    name: str  # the XLA operation (hlo_op) where the trace names it, else the kernel's own name
    kind: str
    calls: int
    seconds: float  # self time over all traced steps
    share: float  # of the busy time
    kernel: str  # one kernel this operation ran (on a GPU: cuBLAS's or cuDNN's name, which says the algorithm)


@dataclasses.dataclass(frozen=True)
class KernelTable:
    rows: list[KernelRow]  # slowest first
    busy_s: float  # the sum of every operation's self time
    span_s: float  # from the first operation's start to the last one's end
    source: str  # "gpu streams", "gpu xla ops line" or "cpu runtime"
    trace: str  # the trace file read

    def by_kind(self) -> dict[str, float]:
        """Share of the busy time per kind, largest first."""
        totals: dict[str, float] = defaultdict(float)
        for row in self.rows:
            totals[row.kind] += row.share
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def as_dict(self, top: int = 25) -> dict[str, Any]:
        return {
            "busy_s": self.busy_s,
            "span_s": self.span_s,
            "source": self.source,
            "by_kind": self.by_kind(),
            "rows": [dataclasses.asdict(r) for r in self.rows[:top]],
            "rows_left_out": max(0, len(self.rows) - top),
        }


def newest_trace(path: str | os.PathLike) -> Path:
    """The newest perfetto_trace.json.gz under `path` (a trace directory or the file itself)."""
    path = Path(path)
    if path.is_file():
        return path
    found = glob.glob(str(path / "**" / "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"kernel_table: no perfetto_trace.json.gz under {path} (trace with create_perfetto_trace=True, "
            "as jaxnn's --profile-dir does)"
        )
    return Path(max(found, key=os.path.getmtime))


def _names(events: list[dict]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    return processes, threads


def _operations(events: list[dict]) -> tuple[list[dict], str]:
    """The events that are device work: kernels on a GPU's streams if the trace has any (else the GPU's "XLA Ops"
    line), else the CPU runtime's XLA operations (the events that carry an `hlo_op`)."""
    processes, threads = _names(events)
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]

    def on_a_stream(e: dict) -> bool:
        thread = threads.get((e["pid"], e.get("tid")), "")
        return "/device:GPU" in processes.get(e["pid"], "") and thread.startswith("Stream")

    gpu = [e for e in complete if on_a_stream(e)]
    if gpu:
        return gpu, "gpu streams"
    # A GPU trace whose kernel lines are named otherwise: the profiler's own per-operation line, counted once.
    ops_line = [
        e
        for e in complete
        if "/device:GPU" in processes.get(e["pid"], "") and threads.get((e["pid"], e.get("tid")), "") == "XLA Ops"
    ]
    if ops_line:
        return ops_line, "gpu xla ops line"
    cpu = [e for e in complete if "hlo_op" in e.get("args", {}) and not _RUNTIME_EVENT.match(e.get("name", ""))]
    return cpu, "cpu runtime"


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event with its duration less the time of the events nested inside it on the same thread."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    out = []
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, self time so far]
        for e in thread:
            while stack and e["ts"] >= stack[-1][1]:
                done = stack.pop()
                out.append((done[0], done[2]))
            if stack:
                stack[-1][2] -= min(e["dur"], stack[-1][1] - e["ts"])
            stack.append([e, e["ts"] + e["dur"], float(e["dur"])])
        out.extend((entry[0], entry[2]) for entry in stack)
    return out


def kernel_table(trace: str | os.PathLike, hlo_text: str | None = None) -> KernelTable:
    """Reads a trace (a directory holding perfetto_trace.json.gz, or the file) into a KernelTable. With the traced
    program's `hlo_text` (`compiled.as_text()`), each operation's kind comes from what its HLO computes; without
    it, from its name."""
    hlo_kinds = kinds_from_hlo(hlo_text) if hlo_text else {}
    path = newest_trace(trace)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    operations, source = _operations(events)
    if not operations:
        raise ValueError(f"kernel_table: {path} has no device operations (was anything run while tracing?)")
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kernels: dict[str, str] = {}
    for event, self_us in _self_times(operations):
        name = event.get("args", {}).get("hlo_op") or event["name"]
        seconds[name] += max(self_us, 0.0) * 1e-6
        calls[name] += 1
        kernels.setdefault(name, event["name"])
    busy = sum(seconds.values())
    span = (max(e["ts"] + e["dur"] for e in operations) - min(e["ts"] for e in operations)) * 1e-6
    rows = [
        KernelRow(
            name,
            hlo_kinds.get(name) or kind_of(f"{kernels[name]} {name}"),
            calls[name],
            s,
            s / busy if busy else 0.0,
            kernels[name],
        )
        for name, s in seconds.items()
    ]
    rows.sort(key=lambda r: -r.seconds)
    return KernelTable(rows, busy, span, source, str(path))


def trace_steps(run_step: Callable[[], Any], *, steps: int = 3, log_dir: str | os.PathLike | None = None) -> Path:
    """Runs `run_step()` once untraced (it may compile), then `steps` times under a trace; returns the trace
    directory (`log_dir`, or a new temporary one). Waits for each step's results, so every traced step is whole."""
    if steps < 1:
        raise ValueError(f"trace_steps: steps must be >= 1, got {steps}")
    out = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="jaxnn-trace-"))
    jax.block_until_ready(run_step())
    jax.profiler.start_trace(str(out), create_perfetto_trace=True)
    try:
        for _ in range(steps):
            jax.block_until_ready(run_step())
    finally:
        jax.profiler.stop_trace()
    return out


def step_breakdown(
    run_step: Callable[[], Any],
    compiled: Any | None,
    trace_dir: str | os.PathLike,
    steps: int = 2,
    top: int = 25,
) -> dict:
    """`steps` more calls of `run_step` (a `jaxnn.profile.timing.stepper` of the `compiled` step) under a trace in
    `trace_dir`, read into a JSON-able table: the `top` slowest operations and each kind's share. Without
    `compiled` (a jitted step, whose compiled form would cost a second compile), kinds come from the names. A
    failure is recorded as {"error": ...}, not raised, so the timings it sits beside still stand."""
    try:
        hlo = compiled.as_text() if compiled is not None else None
        table = kernel_table(trace_steps(run_step, steps=steps, log_dir=trace_dir), hlo)
    except Exception as err:  # a profiler that cannot start here must not cost the measurement
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    return {"steps": steps, "busy_s_per_step": table.busy_s / steps, "trace": table.trace, **table.as_dict(top=top)}


def format_kernel_table(table: KernelTable, top: int = 20, steps: int | None = None) -> str:
    """The table as text: the `top` slowest operations, then the share of each kind. With `steps`, times are per
    step."""
    per = steps or 1
    unit = "ms/step" if steps else "ms"
    lines = [
        f"{table.source}: {table.busy_s / per * 1e3:.2f} {unit} busy over a span of {table.span_s / per * 1e3:.2f}"
        f" ({len(table.rows)} operations; {table.trace})",
        f"{'operation':<44} {'kind':<12} {'calls':>6} {unit:>9} {'share':>6}  kernel",
    ]
    for r in table.rows[:top]:
        lines.append(
            f"{r.name[:44]:<44} {r.kind:<12} {r.calls:>6} {r.seconds / per * 1e3:>9.3f} {100 * r.share:>5.1f}%  "
            f"{r.kernel[:60]}"
        )
    if len(table.rows) > top:
        lines.append(f"... {len(table.rows) - top} more")
    lines.append("by kind: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in table.by_kind().items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxnn.profile.kernel_table", description="Where a traced program's device time went."
    )
    parser.add_argument("trace", help="a trace directory (e.g. a run's --profile-dir) or a perfetto_trace.json.gz")
    parser.add_argument("--top", type=int, default=20, help="how many operations to list (default 20)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    try:
        table = kernel_table(args.trace)
    except (FileNotFoundError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    print(json.dumps(table.as_dict(args.top), indent=2) if args.json else format_kernel_table(table, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
