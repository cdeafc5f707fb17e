"""FLOPs and bytes of one call of a compiled program: XLA's cost analysis, with jaxnn's oneDNN kernels counted from
their shapes (`kernel_cost`), the one count every FLOP figure in jaxnn reads.

Internal, below the layers and the profiler alike: the layers' summary (`layers.tabulate`) and `jaxnn profile` both
count with it, and the public names stay `jaxnn.profile.timing.cost_counts`, `flops_of` and `compiled_flops`.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxnn._src.kernel_cost import kernel_costs


def compiled_flops(jitted: jax.stages.Wrapped, *args: Any) -> float | None:
    """FLOPs of one call of a jitted function, from XLA's cost analysis of the compiled program (None if absent)."""
    try:
        compiled = jitted.lower(*args).compile()
    except Exception:  # some backends do not implement cost analysis
        return None
    return flops_of(compiled)


def flops_of(compiled: jax.stages.Compiled) -> float | None:
    """FLOPs of one call of an already compiled (`jit(f).lower(...).compile()`) program, or None (also for 0)."""
    flops, _ = cost_counts(compiled)
    return flops or None


def cost_counts(stage: jax.stages.Compiled | jax.stages.Lowered) -> tuple[float | None, float | None]:
    """(FLOPs, bytes accessed) of one call of a compiled (or lowered) program: XLA's cost analysis, with jaxnn's
    oneDNN kernels counted from their shapes (`kernel_cost`), so that the count is the model's, not its kernels'.
    The one count every FLOP figure in jaxnn reads: layer tables, `jaxnn profile`, benchmarks, projections.

    XLA leaves out zero counts (a reshape-only program has no "flops"), so a missing key with an analysis present
    means 0; no analysis at all (some backends) means unknown, None. Older jax returns a list of one dict per
    computation, newer a dict.
    """
    try:
        cost = stage.cost_analysis()
    except Exception:  # some backends do not implement cost analysis
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not isinstance(cost, dict) or not cost:
        return None, None
    # XLA adds -1 FLOPs and -1 bytes ("unknown") for each custom call: taken back for the kernels counted here.
    kernel_flops, kernel_bytes, calls = kernel_costs(_hlo_text(stage))
    flops = float(cost.get("flops", 0.0)) + kernel_flops + calls
    nbytes = float(cost.get("bytes accessed", 0.0)) + kernel_bytes + calls
    return (flops if flops >= 0 else None), (nbytes if nbytes > 0 and math.isfinite(nbytes) else None)


def _hlo_text(stage: jax.stages.Compiled | jax.stages.Lowered) -> str:
    try:
        text = stage.as_text(dialect="hlo") if isinstance(stage, jax.stages.Lowered) else stage.as_text()
    except Exception:  # a backend without HLO text has no kernels of ours to count either
        return ""
    return text or ""
