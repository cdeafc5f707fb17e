"""Timing that waits for the device, FLOP counts from the compiler (`cost_counts`, `flops_of`, `compiled_flops`,
counted in `jaxnn._src.xla_cost`), and the measured matmul peak.

Runnable benchmarks built on these live in the top-level `benchmarks/` folder, never in the library.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# Counted below the layers (the layers' summary reads them too); re-exported here, their public home.
from jaxnn._src.xla_cost import compiled_flops as compiled_flops
from jaxnn._src.xla_cost import cost_counts as cost_counts
from jaxnn._src.xla_cost import flops_of as flops_of

# Every timing warms up first (compilation and caches), waits for the result with `block_until_ready`, repeats,
# and reports the median and the spread, because the machines these run on are shared and noisy. Rates are meant
# to be compared with a peak measured in the same run (`measure_matmul_peak`), never with a datasheet number.


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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _timing(per_call: list[float], repeats: int, number: int) -> Timing:
    q = np.percentile(per_call, [25, 75])
    return Timing(statistics.median(per_call), float(q[0]), float(q[1]), min(per_call), max(per_call), repeats, number)


def time_fn(
    fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7, number: int | None = None, min_window_s: float = 0.05
) -> Timing:
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
    return _timing(per_call, repeats, number)


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 7, min_window_s: float = 0.05
) -> dict[str, Timing]:
    """Times several functions side by side: each timing window runs every function in turn, so that load from
    other processes falls on all of them alike. The honest way to compare variants on a shared machine."""
    numbers = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            jax.block_until_ready(fn())
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        numbers[name] = max(1, int(min_window_s / max(time.perf_counter() - t0, 1e-7)))
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(numbers[name]):
                out = fn()
            jax.block_until_ready(out)
            per_call[name].append((time.perf_counter() - t0) / numbers[name])
    return {name: _timing(times, repeats, numbers[name]) for name, times in per_call.items()}


class stepper:  # noqa: N801 (used like a function: `time_fn(stepper(step, state, batch))`)
    """`stepper(step_fn, state, batch)()` runs `state, _ = step_fn(state, batch)` and returns the new state.

    A step that donates its state deletes the buffers it was given, so each call must feed the previous call's
    output; `.state` is the latest state, and may be set to restart from another one.
    """

    __slots__ = ("step_fn", "state", "batch")

    def __init__(self, step_fn: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any) -> None:
        self.step_fn, self.state, self.batch = step_fn, state, batch

    def __call__(self) -> Any:
        self.state, _ = self.step_fn(self.state, self.batch)
        return self.state


def matmul_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def measure_matmul_peak(
    size: int = 2048, dtype: DTypeLike = jnp.bfloat16, device: jax.Device | None = None, repeats: int = 5
) -> dict[str, Any]:
    """The peak GFLOP/s of one large square matmul accumulated in float32, the ceiling models are compared with:
    the rate of its fastest timing window (a ceiling is what the machine reaches; on a shared machine slower
    windows caught another process's load). The one definition of a peak in jaxnn: `make bench`, the experiments
    and `jaxnn profile` all use it. `gflops_median` is the median window's rate."""
    device = device or jax.devices()[0]
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype), device)
    b = jax.device_put(jax.random.normal(key_b, (size, size), jnp.float32).astype(dtype), device)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    timing = time_fn(lambda: matmul(a, b), repeats=repeats)
    return {
        "size": size,
        "dtype": jnp.dtype(dtype).name,
        "gflops": matmul_flops(size, size, size) / timing.min / 1e9,
        "gflops_median": matmul_flops(size, size, size) / timing.median / 1e9,
        "timing": timing.as_dict(),
    }


def measure_copy_bandwidth(
    mib: int = 256, device: jax.Device | None = None, repeats: int = 5, dtype: DTypeLike = jnp.float32
) -> dict[str, Any]:
    """The achieved bytes/s of one large elementwise pass (`x + 1`: reads `mib` MiB, writes as much).

    An add rather than a plain copy, because XLA forwards a jitted identity's input buffer and does no work; the
    bytes counted are XLA's own cost analysis of the compiled program (read plus written), so they are the same
    measure as the per-layer bytes they are compared with.
    """
    device = device or jax.devices()[0]
    n = mib * 2**20 // jnp.dtype(dtype).itemsize
    x = jax.device_put(jnp.zeros((n,), dtype), device)
    compiled = jax.jit(lambda x: x + jnp.asarray(1, dtype)).lower(x).compile()
    moved = cost_counts(compiled)[1] or 2.0 * n * jnp.dtype(dtype).itemsize
    timing = time_fn(lambda: compiled(x), repeats=repeats)
    return {"mib": mib, "bytes": moved, "bytes_per_s": moved / timing.median, "timing": timing.as_dict()}
