"""What every experiment shares: the machine tag, size presets, time budgets, results files and plots.

A results file is `<out>/<machine-tag>/<name>.json`: the machine it ran on (read from the system), the date, the jax
version, the size preset, and every measured figure. The report reads these files and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

SIZES = ("tiny", "quick", "full", "gpu")
SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------------------- the machine


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where the file does not exist, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use, not the host's total
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        match = None
    return match.group(1).strip() if match else platform.processor() or platform.machine()


def cpu_model_slug(model: str) -> str:
    """`intel-xeon` from 'Intel(R) Xeon(R) Processor @ 2.80GHz', `amd-epyc-9r14` from 'AMD EPYC 9R14 96-Core
    Processor': vendor and model, without trademarks, clock and core count."""
    text = re.sub(r"\((r|tm)\)|@.*$|\b\d+-core\b|\bcpu\b|\bprocessor\b", " ", model, flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:32].rstrip("-") or "unknown"


def cpu_tag(model: str | None = None, flags: set[str] | None = None, cores: int | None = None) -> str:
    """E.g. `cpu-intel-xeon-2core-avx512-bf16-amx`: the CPU's vendor and model, the cores this process may use,
    and the vector and matrix units XLA can use (AVX-512, AVX512-BF16 dot products, AMX tiles), so that results of
    two machines that differ in them never share a folder. Defaults: this machine's."""
    flags = cpu_flags() if flags is None else flags
    parts = [
        "cpu",
        cpu_model_slug(cpu_model() if model is None else model),
        f"{cpu_cores() if cores is None else cores}core",
    ]
    if "avx512f" in flags:
        parts.append("avx512")
    elif "avx2" in flags:
        parts.append("avx2")
    if "avx512_bf16" in flags:
        parts.append("bf16")
    if flags & {"amx_tile", "amx_bf16"}:
        parts.append("amx")
    if platform.machine() in ("aarch64", "arm64"):
        parts.append("arm64")
    return "-".join(parts)


def device_tag(device) -> str:
    """`gpu-h200` from 'NVIDIA H200', `tpu-v5-lite` from 'TPU v5 lite'; the CPU tag for a CPU device."""
    if device.platform == "cpu":
        return cpu_tag()
    kind = re.sub(r"^(nvidia|amd)\s+", "", device.device_kind.strip(), flags=re.IGNORECASE)
    kind = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
    return f"{device.platform}-{kind}"


def params_label(count: float) -> str:
    """A parameter count in the unit that keeps its figure readable: "8.1k", "412k", "1.3M", "124M", "7B" (a
    fixed "M" prints a model under half a million parameters as "0M")."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.2g}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{count:.0f}"


def machine_tag() -> str:
    """The tag of the default backend's first device; results from this process go under it."""
    return device_tag(jax.devices()[0])


def machine_info() -> dict:
    device = jax.devices()[0]
    return {
        "tag": machine_tag(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_model": cpu_model(),
        "cpu_cores": cpu_cores(),
        "cpu_flags": sorted(
            cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "fma"}
        ),
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        # Shared machines are noisy: the 1-minute load average says how busy this one was when the run ended.
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def backends_present() -> list[str]:
    """The default backend first, then the host CPU if the default is an accelerator (both are always measured)."""
    default = jax.default_backend()
    return [default] if default == "cpu" else [default, "cpu"]


def interleaved(sizes: dict[str, list], order: Callable[[list], list] = sorted) -> list[tuple]:
    """(size, backend) pairs, every backend's row of one size before the next size: `sizes` maps a backend to its
    sizes, `order` orders their union once for all. A GPU compiles once per row, so a budget that runs out
    row by row would otherwise leave the host CPU, measured after it, with none of the rows it is compared on."""
    return [
        (size, backend)
        for size in order(sorted(set().union(*sizes.values())))
        for backend in sizes
        if size in sizes[backend]
    ]


def first_device(backend: str):
    return jax.devices(backend)[0]


# ---------------------------------------------------------------------------------------------------- budgets


class Budget:
    """A soft wall-clock budget: an experiment checks it between measurements and skips what would not fit."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def over(self, fraction: float = 1.0) -> bool:
        """True once `fraction` of the budget is spent."""
        return self.seconds is not None and self.elapsed() > fraction * self.seconds

    def skip(self, what: str) -> None:
        self.skipped.append(what)


def preset(table: dict, size: str):
    """The entry of a per-size table; `full` falls back to `quick` and `tiny` must always exist."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {SIZES}")
    return table[size] if size in table else table["quick"]


# ---------------------------------------------------------------------------------------------------- measuring


def latency_samples(
    fn: Callable[[], object], *, calls: int, warmup: int = 3, max_seconds: float | None = None
) -> np.ndarray:
    """Seconds of each of `calls` separate calls of `fn` (which must finish its work, e.g. copy back to the host).

    `timing.time_fn` reports windows of calls, which hides the tail; real-time inference cares about single
    calls, so p99 needs every call timed on its own.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
        if max_seconds is not None and time.perf_counter() - start > max_seconds and len(samples) >= 5:
            break
    return np.asarray(samples)


def relative_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere gives inf, so it can never pass as accurate."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def custom_calls(hlo_text: str) -> list[str]:
    """The library calls (custom-call targets) in a compiled HLO module's text, e.g. `__cublas$lt$matmul`."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


# ---------------------------------------------------------------------------------------------------- results


def results_path(out: str | Path, name: str, tag: str | None = None) -> Path:
    return Path(out) / (tag or machine_tag()) / f"{name}.json"


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if np.isfinite(value) else None  # JSON has no inf/NaN; None reads as "no figure"
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def write_results(out: str | Path, name: str, size: str, figures: dict, budget: Budget | None = None) -> Path:
    """Writes `<out>/<tag>/<name>.json` (or beside it, where that one is committed: `output_path`) and returns
    the path written."""
    path = output_path(results_path(out, name))
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "size": size,
        "machine": machine_info(),
        "seconds": round(budget.elapsed(), 2) if budget else None,
        "budget_s": budget.seconds if budget else None,
        "skipped": budget.skipped if budget else [],
        **_jsonable(figures),
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def committed(path: str | Path) -> bool:
    """Whether git tracks `path` (a committed result the report and the docs cite); False outside a checkout."""
    path = Path(path).resolve()
    if not path.exists():
        return False
    try:
        proc = subprocess.run(
            ["git", "-C", str(path.parent), "ls-files", "--error-unmatch", path.name], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


LOCAL = "-local"  # the suffix of a file written beside a committed one, which it stands in for when read back
_overwrite = False  # --overwrite of this process (`set_overwrite`): replace committed results files


def set_overwrite(overwrite: bool) -> None:
    """Whether this process may replace results files git tracks (`--overwrite`); without it they stay as they are
    and the new figures go beside them (`output_path`)."""
    global _overwrite
    _overwrite = bool(overwrite)


def output_path(path: str | Path) -> Path:
    """Where a results file meant for `path` is written: `path` itself, or, where git tracks `path` (another
    machine's or an earlier run's committed figures) and `--overwrite` was not given, `<stem>-local<suffix>` beside
    it, which the readers (`load_results`, `experiments.projected.load`) prefer. A rerun writes new files; the
    committed ones are replaced only when told to."""
    path = Path(path)
    if _overwrite or not committed(path):
        return path
    local = path.with_name(f"{path.stem}{LOCAL}{path.suffix}")
    print(f"note: {path} is a committed result; writing {local.name} beside it (--overwrite replaces it)")
    return local


def load_results(root: str | Path) -> dict[str, dict[str, dict]]:
    """`{machine_tag: {experiment_name: record}}` for every results file under `root`."""
    found: dict[str, dict[str, dict]] = {}
    # A "-local" file (a rerun beside a committed one, `output_path`) is read last, so it stands in for that one.
    for path in sorted(Path(root).glob("*/*.json"), key=lambda p: (p.parent.name, p.stem.endswith(LOCAL), p.name)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"unreadable results file {path}: {err}") from err
        if isinstance(record, dict) and "name" in record:
            found.setdefault(path.parent.name, {})[record["name"]] = record
    return found


# ---------------------------------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib with the file-only Agg backend (no display on servers or the GPU machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Line style and marker per curve: curves that coincide (three precisions training to the same loss) must still be
# told apart, which colour alone does not do once one line is drawn over the others.
CURVE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "x"))


def curve_style(i: int, points: int) -> dict:
    """Matplotlib keywords for the `i`-th curve of a plot: its own line style and marker, markers thinned to about
    ten per curve and set off from the other curves' so that stacked curves show every marker."""
    line, marker = CURVE_STYLES[i % len(CURVE_STYLES)]
    every = max(points // 10, 1)
    return {"ls": line, "marker": marker, "markevery": (i * every // len(CURVE_STYLES) % every, every), "ms": 4}


def coincide_note(curves: dict[str, list[float]], tolerance: float = 0.03) -> str | None:
    """A note for the plot when some curves lie within `tolerance` (relative, at every shared point) of the first
    one: "bf16, fp16 lie within 0.4% of fp32 throughout"; None when none do."""
    items = [(k, np.asarray(v, dtype=float)) for k, v in curves.items() if len(v)]
    if len(items) < 2:
        return None
    (first, ref), close, worst = items[0], [], 0.0
    for label, values in items[1:]:
        n = min(len(ref), len(values))
        gap = float(np.nanmax(np.abs(values[:n] - ref[:n]) / np.maximum(np.abs(ref[:n]), 1e-12)))
        if gap <= tolerance:
            close.append(label)
            worst = max(worst, gap)
    return f"{', '.join(close)} lie within {worst:.1%} of {first} throughout" if close else None


def save_figure(fig, json_path: Path) -> Path:
    png = json_path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    pyplot().close(fig)
    return png


# ---------------------------------------------------------------------------------------------------- entry point


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--size",
        choices=SIZES,
        default="quick",
        help="tiny: tests; quick: minutes on a laptop CPU; full: longer CPU run; gpu: one H200",
    )
    parser.add_argument("--out", default="results", help="results folder (a subfolder per machine tag)")
    parser.add_argument("--budget", type=float, default=None, help="soft time budget in seconds")
    add_overwrite_flag(parser)
    return parser


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    """`--overwrite`: replace results files that git tracks (otherwise written beside them, `output_path`)."""
    parser.add_argument(
        "--overwrite", action="store_true", help="replace committed results files (else new ones go beside them)"
    )


def run_and_save(
    name: str, run: Callable, plot: Callable, size: str, out: str | Path, budget_s: float | None = None
) -> tuple[Path, dict]:
    """Runs one experiment, writes its JSON and PNG, and returns (json path, record)."""
    budget = Budget(budget_s)
    figures = run(size=size, budget=budget)
    path = write_results(out, name, size, figures, budget)
    record = json.loads(path.read_text())
    plot(record, path)
    return path, record


def main(name: str, run: Callable, plot: Callable, summarize: Callable, argv=None) -> None:
    """The `python -m experiments.<name>` entry point shared by every experiment."""
    parser = add_args(argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=run.__doc__))
    args = parser.parse_args(argv)
    set_overwrite(args.overwrite)
    try:
        path, record = run_and_save(name, run, plot, args.size, args.out, args.budget)
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"{name}: wrote {path} and {path.with_suffix('.png').name} in {record['seconds']} s")
    for line in summarize(record):
        print("  " + line)


# ---------------------------------------------------------------------------------------------------- compiled HLO

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_KIND = re.compile(r'"kind"\s*:\s*"(__[^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def library_calls(hlo_text: str) -> list[dict]:
    """The library kernels a compiled HLO module calls: custom calls (cuBLAS, cuDNN, oneDNN) and library fusions
    (Triton GEMMs, cuDNN fusions, XNNPACK/YNNPACK), each with its target and its operands' element types.

    Compiled HLO prints operands by name only, so their types are looked up from the instructions that define them.
    """
    types: dict[str, str] = {}
    calls = []
    for line in hlo_text.splitlines():
        match = _INSTR.match(line)
        if not match:
            continue
        types[match["name"]] = match["type"]
        target = _TARGET.search(match["rest"]) or (_KIND.search(match["rest"]) if match["op"] == "fusion" else None)
        if target:
            # Operands print as `%name`, or as `bf16[64,64]{1,0} %name` in some printers.
            typed = {n: d for d, n in re.findall(r"(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+%([\w.\-]+)", match["args"])}
            dtypes = []
            for arg in re.findall(r"%([\w.\-]+)", match["args"]):
                found = typed.get(arg) or (re.match(r"\(?(\w+)\[", types.get(arg, "")) or [None, None])[1]
                dtypes.append(found or "?")
            calls.append(
                {
                    "target": target.group(1),
                    "op": match["op"],
                    "operand_dtypes": dtypes,
                    "result": re.sub(r"\{[^}]*\}", "", match["type"]),
                }
            )
    return calls


def compiled_hlo(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()


def init_train_state(model, tx, in_shape, policy="fp32", device=None, seed: int = 0):
    """`create_train_state` compiled as one program and committed to `device`.

    One compilation instead of one per eager initialiser op (seconds on a busy 2-core CPU), and committed like the
    states a jitted step returns, so the step compiles once rather than once for each placement.
    """
    from jax.sharding import SingleDeviceSharding

    from jaxnn.train import create_train_state

    device = device or jax.devices()[0]
    create = jax.jit(
        lambda key: create_train_state(model, tx, key, in_shape, policy), out_shardings=SingleDeviceSharding(device)
    )
    return create(jax.random.key(seed))
