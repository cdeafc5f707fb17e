"""The text table of a `jaxnn.profile.Profile`: measured columns, then the projected accelerator's, then the sum of
the layers against the whole model compiled as one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxnn.profile import Profile

_SHORT = {"forward": "fwd", "forward+backward": "fwd+bwd"}
_MEASURED = ("layer", "pass", "ms", "GFLOP", "MB", "FLOP/B", "GFLOP/s", "%peak", "GB/s", "%BW", "bound")
_PROJECTED = ("µs bound", "speed-up")


def _num(x: float | None, scale: float = 1.0, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x / scale, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


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
        + f"); ridge point {pk.ridge(p.dtype):.1f} FLOP/B",
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
        "train mode, gradients for the parameters and the input. %BW over 100: the layer's bytes come from "
        "caches, the bandwidth ceiling is main memory's."
    )
    return "\n".join(lines)
