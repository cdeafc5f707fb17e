"""The measurement behind `jaxnn.profile`: the machine's ceilings and each layer's compiled programs.

Each top-level layer (each child of a `serial`, as in `jaxnn.layers.summary`) is compiled alone, twice: its forward
pass (inference: eval mode) and its forward+backward pass (training mode; gradients with respect to its parameters
and, except for the first layer, to its input, as the backward pass of a step needs). Each program is timed
(waiting for the device, median of several windows) and XLA's cost analysis of the same compiled program gives its
FLOPs and bytes accessed. From those: arithmetic intensity (FLOP/byte), achieved FLOP/s and bytes/s, their fractions
of the machine's matmul peak (for the policy's compute dtype) and copy bandwidth, both measured in the same run, and
the bound: compute when the intensity is above the ridge point (peak / bandwidth) of the memory the program's
bytes come from (the caches' for a program whose bytes fit in them, main memory's otherwise), or when it runs at
half the matmul peak or more; memory otherwise. The ceilings are the best of several interleaved rounds, with a
note when the machine is busy.

The whole model is compiled and timed the same way: the sum of the layers' times minus the whole model's time is
what compiling the layers together saves (fusion across layer boundaries) or costs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn._src.cpu import cpu_info
from jaxnn.layers.combinators import splits_input
from jaxnn.layers.core import Layer, init_model, run
from jaxnn.layers.tabulate import guess_input, named_children
from jaxnn.precision import Policy, get_policy
from jaxnn.profile.projection import Accelerator
from jaxnn.profile.results import PASSES, LayerRow, MachinePeaks, Profile, ProfileError
from jaxnn.profile.timing import cost_counts, measure_copy_bandwidth, measure_matmul_peak, time_fn

# The CPU features that decide what XLA can use for products; named next to every CPU figure.
_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


# ---------------------------------------------------------------------------------------------------- the machine


def describe_device(device: jax.Device | None = None) -> str:
    """The device in words: for a CPU its model name, the cores this process may use and its matrix/vector units
    (from /proc/cpuinfo); otherwise jax's device kind."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform} {device.device_kind}"
    model, flags, cores = cpu_info()
    if model is None and not flags:
        return f"cpu ({cores} cores)"
    features = [f for f in _CPU_FEATURES if f in flags]
    return f"{model or 'cpu'}, {cores} cores, {' '.join(features) or 'no AVX-512/AMX'}"


def measure_peaks(
    dtypes: Sequence[Any] = (jnp.float32, jnp.bfloat16),
    *,
    matmul_size: int = 2048,
    copy_mib: int = 256,
    repeats: int = 5,
    rounds: int = 3,
) -> MachinePeaks:
    """Times a `matmul_size`^2 product per dtype (accumulating in float32) and an elementwise pass over `copy_mib`
    MiB on the default device, in `rounds` interleaved rounds of `repeats` windows each; each ceiling is the rate
    of the fastest window of all. A machine visibly busy with other work, or ceilings that differ widely between
    rounds, is said in `MachinePeaks.notes` (and under the profile's table)."""
    names = sorted({jnp.dtype(d).name for d in dtypes})
    # A ceiling is what the machine can reach, so each comes from its fastest window: on a shared machine the
    # median of a few windows often catches another process's load and would put layers above the roof, and a
    # bandwidth measured under load would move the ridge point and call compute-bound layers memory-bound.
    flops: dict[str, list[float]] = {name: [] for name in names}
    copies: list[float] = []
    cached: list[float] = []
    cache_mib = max(1, min(4, copy_mib // 8))
    for _ in range(rounds):
        for name in names:
            peak = measure_matmul_peak(matmul_size, name, repeats=repeats)
            flops[name].append(peak["gflops"] * 1e9)
        copy = measure_copy_bandwidth(copy_mib, repeats=repeats)
        copies.append(copy["bytes"] / copy["timing"]["min"])
        small = measure_copy_bandwidth(cache_mib, repeats=repeats)
        cached.append(small["bytes"] / small["timing"]["min"])
    notes = _load_notes(copies, flops)
    best = {name: max(rates) for name, rates in flops.items()}
    return MachinePeaks(describe_device(), best, max(copies), matmul_size, copy_mib, max(cached), cache_mib, notes)


def _load_notes(copies: list[float], flops: dict[str, list[float]]) -> tuple[str, ...]:
    """What says the ceilings may be low: the load average against the usable cores, and rounds that disagree."""
    notes = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    if load is not None and load > 0.75 * cores:
        notes.append(
            f"the machine is busy (load average {load:.1f} on {cores} usable cores): ceilings are the best of "
            "every round, and may still be low"
        )
    for what, rates in (("copy bandwidth", copies), *((f"{n} matmul", r) for n, r in flops.items())):
        if len(rates) > 1 and max(rates) > 2 * min(rates):
            notes.append(f"{what} varied {max(rates) / min(rates):.1f}x between rounds (another process at work)")
    return tuple(notes)


# ---------------------------------------------------------------------------------------------------- measuring


def profile_layers(
    model: Layer,
    in_shape: Sequence[int],
    *,
    batch_size: int = 32,
    policy: Policy | str | None = "fp32",
    peaks: MachinePeaks | None = None,
    accelerator: Accelerator | None = None,
    repeats: int = 5,
    min_window_s: float = 0.02,
    id_range: int = 2,
    seed: int = 0,
    print_fn: Callable[[str], Any] | None = None,
) -> Profile:
    """Profiles each top-level layer of `model` on a batch of `batch_size` inputs of `in_shape` (one example's shape,
    without the batch dimension); see the module docstring for what is measured.

    Float inputs are standard normal in the policy's compute dtype; a model that fails on floats gets integer ids
    drawn from [0, `id_range`) (token ids: pass the vocabulary size). `peaks` defaults to measuring them now (a few
    seconds); pass one `MachinePeaks` to several calls to measure once. With an `accelerator`, each row also gets
    the projected lower bound and speed-up. The table goes through `print_fn` unless it is None.
    """
    in_shape = _check_args(model, in_shape, batch_size, repeats, id_range)
    policy = get_policy(policy)
    dtype = jnp.dtype(policy.compute_dtype)
    peaks = peaks or measure_peaks((dtype,))
    if dtype.name not in peaks.matmul_flops:
        raise ProfileError(f"profile_layers: the peaks given have no {dtype.name} matmul; measure_peaks with it")
    shape = (batch_size, *in_shape)
    # One compiled initialisation: eagerly, every initialiser op compiles on its own (seconds for a few layers).
    params, state = jax.jit(lambda key: init_model(model, key, shape)[1:])(jax.random.key(seed))
    params = policy.cast_to_param(params)
    spec = guess_input(model, shape, params, state, policy)
    rng = np.random.default_rng(seed)
    x = _example(spec, id_range, rng)
    measure = _Measure(peaks, accelerator, dtype, policy, repeats, min_window_s)
    rows: list[LayerRow] = []
    children = [] if splits_input(model) else named_children(model)
    for i, (name, child) in enumerate(children or [(model.name, model)]):
        p = params.get(name, {}) if children else params
        s = (state.get(name) if child.stateful else None) if children else state
        row, y = measure.forward(name, child, p, s, x)
        rows += [row, measure.backward(name, child, p, s, x, wrt_input=i > 0)]
        x = y  # the next layer is timed on the input it really receives
    x = _example(spec, id_range, rng)
    whole = (
        measure.forward("whole model", model, params, state, x)[0],
        measure.backward("whole model", model, params, state, x, wrt_input=False),
    )
    bounded_rows, bounded_whole = _bounded(rows, peaks, dtype), _bounded(list(whole), peaks, dtype)
    result = Profile(
        model.name, shape, policy.name, dtype.name, peaks, tuple(bounded_rows), tuple(bounded_whole), accelerator
    )
    if print_fn is not None:
        print_fn(str(result))
    return result


def _check_args(model, in_shape, batch_size, repeats, id_range) -> tuple[int, ...]:
    if not isinstance(model, Layer):
        raise ProfileError(f"profile_layers: model must be a jaxnn Layer, got {type(model).__name__}")
    ok = isinstance(in_shape, (tuple, list)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in in_shape
    )
    if not ok:
        raise ProfileError(
            f"profile_layers: in_shape must be a tuple of positive ints (one example, no batch), got {in_shape!r}"
        )
    for what, value in (("batch_size", batch_size), ("repeats", repeats), ("id_range", id_range)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ProfileError(f"profile_layers: {what} must be a positive integer, got {value!r}")
    return tuple(in_shape)


def _example(spec: Any, id_range: int, rng: np.random.Generator) -> jax.Array:
    """Random inputs drawn on the host: no eager jax op, so nothing compiles but the programs measured."""
    if jnp.issubdtype(spec.dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, id_range, spec.shape).astype(spec.dtype))
    return jnp.asarray(rng.standard_normal(spec.shape, np.float32).astype(spec.dtype))


def _forward(layer: Layer, policy: Policy) -> Callable:
    def forward(params, state, x):
        return run(layer, policy.cast_to_compute(params), x, state=state, key=None, train=False, policy=policy)[0]

    return forward


def _forward_backward(layer: Layer, policy: Policy, wrt_input: bool) -> Callable:
    """The output and the gradients a training step's backward pass needs from this layer, given the output's
    cotangent `g`; the output is returned so that XLA cannot drop the forward work the gradients do not need."""

    def apply(params, x, state, key):
        return run(layer, policy.cast_to_compute(params), x, state=state, key=key, train=True, policy=policy)

    def step(params, state, x, g, key):
        if wrt_input:
            y, vjp, new_state = jax.vjp(lambda p, x: apply(p, x, state, key), params, x, has_aux=True)
        else:
            y, vjp, new_state = jax.vjp(lambda p: apply(p, x, state, key), params, has_aux=True)
        return y, vjp(g), new_state

    return step


# A program running at this fraction of the measured matmul peak is limited by arithmetic, whatever the measured
# bandwidth says: a memory-bound one cannot come near the compute roof.
AT_THE_COMPUTE_ROOF = 0.5


def bound_of(intensity: float | None, ridge: float, peak_fraction: float | None) -> str | None:
    """ "compute" or "memory": from the program's arithmetic intensity against the ridge point (peak / bandwidth),
    and "compute" for one that runs at `AT_THE_COMPUTE_ROOF` of the peak or more, so that a bandwidth measured
    low (a busy machine) cannot call a convolution at 60% of the matmul peak memory-bound."""
    if intensity is None:
        return None
    if intensity >= ridge or (peak_fraction is not None and peak_fraction >= AT_THE_COMPUTE_ROOF):
        return "compute"
    return "memory"


def _bounded(rows: list[LayerRow], peaks: MachinePeaks, dtype: Any) -> list[LayerRow]:
    """The rows with their bound decided once every program is timed. The caches' roof is at least the fastest
    rate any in-cache program of the profile moved its bytes at (a roof below an achieved rate was measured low: a
    busy machine), and serves every program whose bytes fit in the caches or move faster than main memory could
    deliver them (XLA counts bytes per operand use, so a reused operand's bytes mostly come from the caches)."""
    peak = peaks.peak(dtype)
    achieved = [r.bytes_per_s for r in rows if r.bytes_per_s and peaks.fits_in_cache(r.bytes)]
    cache = max([peaks.cache_bandwidth or 0.0, *achieved])
    out = []
    for r in rows:
        from_cache = cache > 0 and (peaks.fits_in_cache(r.bytes) or (r.bytes_per_s or 0.0) > peaks.bandwidth)
        ridge = peak / (cache if from_cache else peaks.bandwidth)
        out.append(dataclasses.replace(r, bound=bound_of(r.intensity, ridge, r.peak_fraction)))
    return out


class _Measure:
    """Compiles, costs and times one program, and turns the figures into a row."""

    def __init__(self, peaks, accelerator, dtype, policy, repeats, min_window_s):
        self.peaks, self.accelerator, self.dtype, self.policy = peaks, accelerator, dtype, policy
        self.repeats, self.min_window_s = repeats, min_window_s

    def forward(self, name: str, layer: Layer, params, state, x) -> tuple[LayerRow, Any]:
        """The row, and the layer's output (the next layer's input)."""
        compiled = jax.jit(_forward(layer, self.policy)).lower(params, state, x).compile()
        return self._row(name, PASSES[0], compiled, (params, state, x), x), compiled(params, state, x)

    def backward(self, name: str, layer: Layer, params, state, x, *, wrt_input: bool) -> LayerRow:
        wrt_input = wrt_input and jnp.issubdtype(x.dtype, jnp.floating)
        y = jax.eval_shape(_forward(layer, self.policy), params, state, x)
        g = _example(y, 2, np.random.default_rng(1))
        args = (params, state, x, g, jax.random.key(2))
        compiled = jax.jit(_forward_backward(layer, self.policy, wrt_input)).lower(*args).compile()
        return self._row(name, PASSES[1], compiled, args, x)

    def _row(self, name: str, pass_: str, compiled, args, x) -> LayerRow:
        flops, nbytes = cost_counts(compiled)
        t = time_fn(lambda: compiled(*args), repeats=self.repeats, min_window_s=self.min_window_s)
        intensity = flops / nbytes if flops is not None and nbytes else None
        flop_s = flops / t.median if flops is not None else None
        byte_s = nbytes / t.median if nbytes is not None else None
        ridge = self.peaks.ridge_for(self.dtype, nbytes)
        projected = self.accelerator.lower_bound(flops, nbytes, self.dtype) if self.accelerator else None
        return LayerRow(
            layer=name,
            pass_=pass_,
            in_shape=tuple(np.shape(x)),
            seconds=t.median,
            p25=t.p25,
            p75=t.p75,
            flops=flops,
            bytes=nbytes,
            intensity=intensity,
            flops_per_s=flop_s,
            bytes_per_s=byte_s,
            peak_fraction=flop_s / self.peaks.peak(self.dtype) if flop_s is not None else None,
            bandwidth_fraction=byte_s / self.peaks.bandwidth if byte_s is not None else None,
            bound=bound_of(intensity, ridge, flop_s / self.peaks.peak(self.dtype) if flop_s is not None else None),
            projected_s=projected,
            speedup=t.median / projected if projected else None,
        )
