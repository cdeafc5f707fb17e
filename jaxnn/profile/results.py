"""What `jaxnn.profile` measures, as values: the machine's ceilings, one row per compiled program, a model's
profile, and the text table a profile prints as."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxnn.errors import ProfileError  # noqa: F401 (also importable from here)
from jaxnn.profile.projection import Accelerator

PASSES = ("forward", "forward+backward")


@dataclasses.dataclass(frozen=True)
class MachinePeaks:
    """The measured ceilings of the roofline: a large matmul's FLOP/s per dtype name and a large copy's bytes/s."""

    device: str
    matmul_flops: dict[str, float]
    bandwidth: float
    matmul_size: int
    copy_mib: int
    # The same pass over a few MiB, which stay in the caches: layers whose data fits there run above the
    # main-memory roof, and this second roof (drawn, not used for the bound) shows how far.
    cache_bandwidth: float | None = None
    cache_mib: int | None = None
    notes: tuple[str, ...] = ()  # what says the ceilings may be low (a busy machine, rounds that disagree)

    def __post_init__(self) -> None:
        rates = {f"{d} matmul FLOP/s": v for d, v in self.matmul_flops.items()} | {"bandwidth": self.bandwidth}
        for what, value in rates.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ProfileError(f"MachinePeaks: {what} must be a positive number, got {value!r}")

    def peak(self, dtype: Any) -> float:
        """The measured matmul FLOP/s for `dtype`."""
        return self.matmul_flops[jnp.dtype(dtype).name]

    def ridge(self, dtype: Any) -> float:
        """FLOP/byte where the matmul ceiling meets the bandwidth ceiling."""
        return self.peak(dtype) / self.bandwidth

    def fits_in_cache(self, nbytes: float | None) -> bool:
        """Whether a program's bytes (all it reads and writes) fit in the pass the cache bandwidth was measured
        over (`cache_mib` read and written): its data then never leaves the caches."""
        return bool(
            self.cache_bandwidth and self.cache_mib and nbytes is not None and nbytes <= 2 * self.cache_mib * 2**20
        )

    def ridge_for(self, dtype: Any, nbytes: float | None) -> float:
        """The ridge point of the memory a program's bytes come from: the caches' when they fit there, main
        memory's otherwise (a small layer's data never leaves the caches, so main memory's roof would call it
        memory-bound at any intensity above its own low ridge)."""
        if self.fits_in_cache(nbytes):
            return self.peak(dtype) / self.cache_bandwidth  # type: ignore[operator]
        return self.ridge(dtype)

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One compiled program: a layer's (or the whole model's) forward or forward+backward pass.

    `seconds` is the median time per call (`p25`, `p75` its spread); `flops` and `bytes` are XLA's cost analysis of
    the program that was timed (None when the backend reports none). `projected_s` is the projected accelerator's
    lower bound for the same counts, `speedup` this machine's measured time over it.
    """

    layer: str
    pass_: str
    in_shape: tuple
    seconds: float
    p25: float
    p75: float
    flops: float | None
    bytes: float | None
    intensity: float | None
    flops_per_s: float | None
    bytes_per_s: float | None
    peak_fraction: float | None
    bandwidth_fraction: float | None
    bound: str | None
    projected_s: float | None = None
    speedup: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A model's per-layer rows for one policy, the whole model's two rows, and the ceilings they are measured
    against; `str()` gives the table."""

    model: str
    in_shape: tuple
    policy: str
    dtype: str
    peaks: MachinePeaks
    rows: tuple[LayerRow, ...]
    whole: tuple[LayerRow, ...]
    accelerator: Accelerator | None = None

    def layer_sum(self, pass_: str) -> float:
        """The sum of the layers' median times for one pass."""
        return sum(r.seconds for r in self.rows if r.pass_ == pass_)

    def whole_time(self, pass_: str) -> float | None:
        """Seconds of the whole model compiled as one program for `pass_` ("forward" or "train"), if measured."""
        return next((r.seconds for r in self.whole if r.pass_ == pass_), None)

    def as_dict(self) -> dict[str, Any]:
        """The profile as plain JSON-ready values, with the per-pass sums of the layers' times."""
        d = dataclasses.asdict(self)
        d["accelerator"] = self.accelerator.as_dict() if self.accelerator else None
        d["layer_sum_s"] = {p: self.layer_sum(p) for p in PASSES}
        d["whole_s"] = {p: self.whole_time(p) for p in PASSES}
        return d

    def __str__(self) -> str:
        return format_profile(self)


# ------------------------------------------------------------------------------------------------------ the table

_SHORT = {"forward": "fwd", "forward+backward": "fwd+bwd"}
_MEASURED = ("layer", "pass", "ms", "GFLOP", "MB", "FLOP/B", "GFLOP/s", "%peak", "GB/s", "%BW", "bound")
_PROJECTED = ("µs bound", "speed-up")


def _num(x: float | None, scale: float = 1.0, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x / scale, fmt)


def _pct(x: float | None) -> str:
    """A fraction as a percentage; above the measured ceiling it reads ">100" (see the table's note)."""
    if x is None:
        return "-"
    return ">100" if x > 1 else f"{100 * x:.1f}"


def _cells(r: Any, projected: bool) -> tuple[str, ...]:
    cells: tuple[str, ...] = (
        r.layer,
        _SHORT.get(r.pass_, r.pass_),
        _num(r.seconds, 1e-3),
        _num(r.flops, 1e9),
        _num(r.bytes, 1e6),
        _num(r.intensity),
        _num(r.flops_per_s, 1e9),
        _pct(r.peak_fraction),
        _num(r.bytes_per_s, 1e9),
        _pct(r.bandwidth_fraction),
        r.bound or "-",
    )
    if projected:
        cells += (_num(r.projected_s, 1e-6), "-" if r.speedup is None else f"{r.speedup:,.0f}x")
    return cells


def format_profile(p: Profile) -> str:
    """The table `str(profile)` prints."""
    projected = p.accelerator is not None
    head = _MEASURED + (tuple(f"{p.accelerator.name} {h}" for h in _PROJECTED) if p.accelerator else ())
    body = [_cells(r, projected) for r in (*p.rows, *p.whole)]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 1, 10) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    pk = p.peaks
    lines = [
        f"{p.model}: input {p.in_shape}, policy {p.policy} ({p.dtype}), measured on {pk.device}",
        f"measured ceilings (fastest window): {p.dtype} matmul {pk.peak(p.dtype) / 1e9:,.0f} GFLOP/s "
        f"({pk.matmul_size}^3 product), "
        f"copy {pk.bandwidth / 1e9:.1f} GB/s ({pk.copy_mib} MiB"
        + (f"; {pk.cache_bandwidth / 1e9:.0f} GB/s over {pk.cache_mib} MiB, in cache" if pk.cache_bandwidth else "")
        + f"); ridge point {pk.ridge(p.dtype):.1f} FLOP/B"
        + (f" ({pk.peak(p.dtype) / pk.cache_bandwidth:.1f} in cache)" if pk.cache_bandwidth else ""),
    ]
    if p.accelerator:
        a = p.accelerator
        lines.append(
            f"projected (not measured): {a.name} {p.dtype} {a.peak(p.dtype) / 1e12:g} TFLOP/s, "
            f"{a.bandwidth / 1e12:g} TB/s ({a.source}); bound = max(FLOPs/peak, bytes/bandwidth)"
        )
    lines += [line(head), rule, *map(line, body[: len(p.rows)]), rule, *map(line, body[len(p.rows) :])]
    for pass_ in ("forward", "forward+backward"):
        whole, total = p.whole_time(pass_), p.layer_sum(pass_)
        if whole:
            verb = "saves" if whole < total else "costs"
            lines.append(
                f"{_SHORT[pass_]}: sum of layers {total * 1e3:.3g} ms, whole model compiled as one "
                f"{whole * 1e3:.3g} ms: compiling the layers together {verb} {abs(total - whole) * 1e3:.3g} ms"
            )
    lines.append(
        "FLOPs and bytes: XLA's cost analysis of each program timed; ms: median per call; fwd: eval mode; fwd+bwd: "
        "train mode, gradients for the parameters and the input. >100 %BW: the layer's bytes come from "
        "caches (the ceiling is main memory's); >100 %peak: the peak was measured low (a busy machine). bound: "
        "intensity against the ridge point of the caches (a program whose bytes fit there) or of main memory, and "
        "compute for any program at half the matmul peak or more."
    )
    lines += [f"note: {n}" for n in pk.notes]
    return "\n".join(lines)
