"""PNG plots of `jaxnn.profile` results: the roofline (measured on this machine, and projected for an accelerator)
with one point per layer and pass, and a bar chart of each layer's time; one colour per precision policy."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxnn._src.optional import require

if TYPE_CHECKING:
    from jaxnn.profile.results import Profile

_MARKERS = {"forward": "o", "forward+backward": "^"}
_WHAT = "plotting the profile"


def _pyplot() -> Any:
    matplotlib = require("matplotlib", _WHAT)
    matplotlib.use("Agg")  # files only: servers have no display
    return require("matplotlib.pyplot", _WHAT)


def _ceilings(
    ax: Any, peak: float, bandwidth: float, color: str, label: str, span: tuple[float, float], style: str = "-"
) -> None:
    import numpy as np

    xs = np.logspace(np.log10(span[0]), np.log10(span[1]), 200)
    ax.plot(xs, np.minimum(peak, xs * bandwidth), style, color=color, lw=1.5, label=label)


def _span(profiles: Sequence[Profile]) -> tuple[float, float]:
    values = [r.intensity for p in profiles for r in (*p.rows, *p.whole) if r.intensity]
    ridges = [p.peaks.ridge(p.dtype) for p in profiles]
    ridges += [p.accelerator.ridge(p.dtype) for p in profiles if p.accelerator]
    lo, hi = min(values + ridges, default=0.1), max(values + ridges, default=100.0)
    return lo / 4, hi * 4


def _panel(ax: Any, peak: float, bandwidth: float, color: str, label: str, span: tuple[float, float]) -> Any:
    """One roofline panel's ceiling for one profile; returns a function that plots a layer's point on it."""
    _ceilings(ax, peak, bandwidth, color, label, span)

    def point(x: float, y: float, pass_: str, name: str | None = None) -> None:
        ax.scatter(x, y, color=color, marker=_MARKERS[pass_], s=28)
        if name is not None:
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 2), textcoords="offset points")

    return point


def roofline_png(profiles: Sequence[Profile], path: str | pathlib.Path) -> pathlib.Path:
    """The measured roofline of this machine (left) and, when the profiles carry an accelerator, the projected one
    (right: each point sits at its lower bound, so on the roof by construction). Returns the path written."""
    plt = _pyplot()
    projected = any(p.accelerator for p in profiles)
    fig, axes = plt.subplots(1, 2 if projected else 1, figsize=(13 if projected else 7, 5), squeeze=False)
    span = _span(profiles)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(profiles):
        color, pk = colors[i % len(colors)], p.peaks
        label = f"{p.policy}: {pk.peak(p.dtype) / 1e9:,.0f} GFLOP/s, {pk.bandwidth / 1e9:.1f} GB/s"
        measured = _panel(axes[0][0], pk.peak(p.dtype), pk.bandwidth, color, label, span)
        if pk.cache_bandwidth and i == 0:
            cache = f"{pk.cache_mib} MiB pass (in cache): {pk.cache_bandwidth / 1e9:.0f} GB/s"
            _ceilings(axes[0][0], pk.peak(p.dtype), pk.cache_bandwidth, "gray", cache, span, style=":")
        for r in p.rows:
            if r.intensity and r.flops_per_s:
                measured(r.intensity, r.flops_per_s, r.pass_, r.layer.split("_")[0])
        if p.accelerator:
            a = p.accelerator
            label = f"{p.policy}: {a.peak(p.dtype) / 1e12:g} TFLOP/s, {a.bandwidth / 1e12:g} TB/s"
            bound = _panel(axes[0][1], a.peak(p.dtype), a.bandwidth, color, label, span)
            for r in p.rows:
                if r.intensity and r.flops and r.projected_s:
                    bound(r.intensity, r.flops / r.projected_s, r.pass_)
    device = profiles[0].peaks.device if profiles else ""
    axes[0][0].set_title(f"measured: {profiles[0].model if profiles else ''}\non {device}", fontsize=9)
    if projected:
        a = next(p.accelerator for p in profiles if p.accelerator)
        axes[0][1].set_title(f"projected, not measured: {a.name} (lower bound per layer)", fontsize=9)
    for ax in axes[0]:
        ax.set(
            xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte, XLA cost analysis)", ylabel="FLOP/s"
        )
        ax.scatter([], [], color="gray", marker="o", label="forward")
        ax.scatter([], [], color="gray", marker="^", label="forward+backward")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def time_png(profiles: Sequence[Profile], path: str | pathlib.Path) -> pathlib.Path:
    """Per layer, the median time of its forward and forward+backward passes, one bar per policy and pass."""
    import numpy as np

    plt = _pyplot()
    layers = list(dict.fromkeys(r.layer for p in profiles for r in p.rows))
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(layers) * max(len(profiles), 1) + 1.5))
    bars = [(p, pass_) for p in profiles for pass_ in _MARKERS]
    height = 0.8 / max(len(bars), 1)
    y = np.arange(len(layers))
    for j, (p, pass_) in enumerate(bars):
        ms = {r.layer: r.seconds * 1e3 for r in p.rows if r.pass_ == pass_}
        ax.barh(y + j * height, [ms.get(name, 0.0) for name in layers], height, label=f"{p.policy} {pass_}")
    ax.set_yticks(y + height * (len(bars) - 1) / 2, layers, fontsize=8)
    ax.invert_yaxis()
    device = profiles[0].peaks.device if profiles else ""
    ax.set_xlabel("median ms per call (measured)")
    ax.set_title(f"time per layer, measured: {profiles[0].model if profiles else ''}\non {device}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7)
    return _save(fig, path)


def write_profile_plots(profiles: Sequence[Profile], out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """roofline.png and layer_time.png in `out_dir` (created); returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [roofline_png(profiles, out / "roofline.png"), time_png(profiles, out / "layer_time.png")]


def _save(fig: Any, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path
