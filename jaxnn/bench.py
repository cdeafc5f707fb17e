"""Timing that waits for the device, FLOP counts from the compiler, and the measured matmul peak.

Every timing warms up first (compilation and caches), calls `block_until_ready` on the result, repeats, and
reports the median and the spread (min, max, and the interquartile range), because these machines are noisy.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: median over `repeats` windows of `number` calls each, with the spread."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    repeats: int
    number: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7, number: int | None = None,
            min_window_s: float = 0.05) -> Timing:
    """Times `fn()` (which must return jax arrays or a pytree of them); `number` calls per window.

    With `number=None`, picks enough calls per window to last about `min_window_s`, so that fast functions are
    not dominated by the timer's own cost.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    if number is None:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        once = max(time.perf_counter() - t0, 1e-7)
        number = max(1, int(min_window_s / once))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(number):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / number)
    q = np.percentile(per_call, [25, 75])
    return Timing(statistics.median(per_call), float(q[0]), float(q[1]), min(per_call), max(per_call), repeats, number)


def compiled_flops(jitted: Callable, *args) -> float | None:
    """FLOPs of one call of a jitted function, from XLA's cost analysis of the compiled program (None if absent)."""
    try:
        cost = jitted.lower(*args).compile().cost_analysis()
    except Exception:  # some backends do not implement cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def matmul_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def measure_matmul_peak(size: int = 2048, dtype=jnp.bfloat16, device=None, repeats: int = 5) -> dict:
    """The achieved GFLOP/s of one large square matmul accumulated in float32 (the rate models are compared with)."""
    device = device or jax.devices()[0]
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype), device)
    b = jax.device_put(jax.random.normal(key_b, (size, size), jnp.float32).astype(dtype), device)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    timing = time_fn(lambda: matmul(a, b), repeats=repeats)
    return {"size": size, "dtype": jnp.dtype(dtype).name, "gflops": matmul_flops(size, size, size) / timing.median / 1e9,
            "timing": timing.as_dict()}
