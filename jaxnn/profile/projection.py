"""A projected accelerator: per layer, the time no device with these peaks can beat, and the speed-up it implies.

The lower bound of one compiled program is max(FLOPs / peak FLOP/s of its dtype, bytes / memory bandwidth): the
roofline model. It is a bound, not a prediction: it leaves out kernel launches (microseconds each on a GPU, which
dominate small layers), and it uses the FLOPs and bytes of the program XLA compiled for the machine at hand, whose
fusion decisions differ from a GPU compiler's.

`GpuModel` goes one step further for REPORT.md's projected GPU column: the roofline of a whole program's
`ProgramCost` plus a launch per kernel, the host's dispatch, host-device copies (latency and bandwidth) and a copy
latency per loop iteration; `H200_MODEL_SOURCES` says where each of its default parameters comes from (datasheet,
measured elsewhere, or assumed). Its figures are projected, not measured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxnn.errors import ProjectionError  # noqa: F401 (also importable from here)

# The H200 figures used when nothing else is given. bf16: the dense bf16 product rate given for an H200 (not
# measured by this project); fp32: NVIDIA's spec sheet (no tensor cores); bandwidth: about 90% of the spec sheet's
# 4.8 TB/s, as a large copy reaches in practice. fp16 runs on the same tensor cores as bf16.
H200_PEAK_FLOPS = {"bfloat16": 790e12, "float16": 790e12, "float32": 67e12}
H200_BANDWIDTH = 4.3e12
H200_SOURCE = (
    "defaults, not measured here: bf16 790 TFLOP/s and 4.3 TB/s as given for an H200, "
    "fp32 67 TFLOP/s from NVIDIA's spec sheet"
)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Peak FLOP/s per dtype name ("float32", "bfloat16", ...) and memory bandwidth (bytes/s); `source` says where
    the figures come from (a spec sheet, or a measured run), and is printed next to every projection."""

    name: str = "H200"
    peak_flops: dict[str, float] = dataclasses.field(default_factory=lambda: dict(H200_PEAK_FLOPS))
    bandwidth: float = H200_BANDWIDTH
    source: str = H200_SOURCE

    def __post_init__(self) -> None:
        for dtype, value in self.peak_flops.items():
            _check_positive(f"{self.name} peak FLOP/s for {dtype}", value)
        _check_positive(f"{self.name} bandwidth", self.bandwidth)

    def peak(self, dtype: DTypeLike) -> float:
        """The device's peak FLOP/s for `dtype`; an error naming the dtypes it has when there is none."""
        name = jnp.dtype(dtype).name
        if name not in self.peak_flops:
            raise ProjectionError(f"{self.name}: no peak FLOP/s for {name}; it has {sorted(self.peak_flops)}")
        return self.peak_flops[name]

    def lower_bound(self, flops: float | None, nbytes: float | None, dtype: DTypeLike) -> float | None:
        """max(flops / peak, bytes / bandwidth) in seconds; None when neither count is known."""
        if flops is None and nbytes is None:
            return None
        return max((flops or 0.0) / self.peak(dtype), (nbytes or 0.0) / self.bandwidth)

    def ridge(self, dtype: DTypeLike) -> float:
        """The arithmetic intensity (FLOP/byte) above which a program is compute-bound on this device."""
        return self.peak(dtype) / self.bandwidth

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values."""
        return dataclasses.asdict(self)


def accelerator(
    name: str = "H200",
    *,
    bf16_tflops: float | None = None,
    fp32_tflops: float | None = None,
    bandwidth_tbs: float | None = None,
    source: str | None = None,
) -> Accelerator:
    """The default H200 with any figure replaced (TFLOP/s and TB/s, as spec sheets print them); a replaced figure
    changes `source` to say so unless `source` is given."""
    peaks = dict(H200_PEAK_FLOPS)
    changed = []
    if bf16_tflops is not None:
        _check_positive("bf16 peak", bf16_tflops)
        peaks["bfloat16"] = peaks["float16"] = bf16_tflops * 1e12
        changed.append(f"bf16 {bf16_tflops:g} TFLOP/s")
    if fp32_tflops is not None:
        _check_positive("fp32 peak", fp32_tflops)
        peaks["float32"] = fp32_tflops * 1e12
        changed.append(f"fp32 {fp32_tflops:g} TFLOP/s")
    bandwidth = H200_BANDWIDTH
    if bandwidth_tbs is not None:
        _check_positive("bandwidth", bandwidth_tbs)
        bandwidth = bandwidth_tbs * 1e12
        changed.append(f"{bandwidth_tbs:g} TB/s")
    if source is None:
        source = H200_SOURCE if not changed else f"given: {', '.join(changed)}; other figures: {H200_SOURCE}"
    return Accelerator(name, peaks, bandwidth, source)


def _check_positive(what: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ProjectionError(f"{what} must be a positive number, got {value!r}")


# ------------------------------------------------------------------------------------------------ the GPU model
# Every parameter of the projected GPU column, with where it comes from. "datasheet": NVIDIA's H200 SXM datasheet
# (dense, no sparsity). "measured elsewhere": H200s measured through PyTorch in November 2026 (769-798 TFLOP/s for
# an 8192^3 bf16 product; about 4.3 TB/s for a device-to-device copy), not by this project. "assumed": typical
# figures for CUDA and jax, no measurement behind them; the first GPU run shows their error (the report sets each
# projection beside its measurement).
H200_MODEL_SOURCES = {
    "bf16": "measured elsewhere: 790 TFLOP/s, the middle of 769-798 for an 8192^3 bf16 product (datasheet: 989)",
    "tf32": "datasheet: 494.5 TFLOP/s dense TF32 (jax's default precision for fp32 products on a GPU)",
    "fp32": "datasheet: 67 TFLOP/s fp32 on CUDA cores (precision=HIGHEST products)",
    "bandwidth": "measured elsewhere: 4.3 TB/s device-to-device copy (datasheet: 4.8 TB/s HBM3e)",
    "launch": "assumed: 5 µs per kernel launch (CUDA launch with XLA's per-kernel overhead, commonly 3-10 µs)",
    "dispatch": "assumed: 20 µs of host work per jitted call (jax's dispatch; hidden behind the device when queued)",
    "transfer": "datasheet and assumed: PCIe Gen5 x16 at 55 GB/s per direction (64 on paper), 10 µs per copy; "
    "an XLA while loop also pays one such latency per iteration (its condition is read on the host)",
}
H200_DATASHEET_BF16 = 989e12


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What the model needs of one compiled program: XLA's FLOPs and bytes for one call (all loop iterations
    included), the kernels it launches, its loop iterations, the host-device copies around a single request, and
    the kind of arithmetic ("bf16", "tf32", "fp32") that sets its peak."""

    flops: float
    nbytes: float
    kind: str
    kernels: int = 1
    loop_trips: int = 0
    h2d_bytes: float = 0.0
    d2h_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """A roofline with per-kernel launch overhead and host-device transfers: projected, not measured.

    device time = kernels x launch + max(FLOPs / peak of its kind, bytes / bandwidth) + loop trips x copy latency;
    a call queued behind others takes max(dispatch, device time) (jax dispatches ahead); a single request takes
    dispatch + copy in + device time + copy out, each copy latency + bytes / PCIe bandwidth. Launches and the
    roofline are added, not overlapped, so a program near both limits is overstated by up to 2x.
    """

    name: str = "H200 (projected, not measured)"
    peaks: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"bf16": 790e12, "fp16": 790e12, "tf32": 494.5e12, "fp32": 67e12}
    )
    bandwidth: float = 4.3e12
    launch_s: float = 5e-6
    dispatch_s: float = 20e-6
    transfer_latency_s: float = 10e-6
    transfer_bandwidth: float = 55e9
    sources: dict[str, str] = dataclasses.field(default_factory=lambda: dict(H200_MODEL_SOURCES))

    def __post_init__(self) -> None:
        for kind, value in self.peaks.items():
            _check_positive(f"{self.name} peak FLOP/s for {kind}", value)
        for field in ("bandwidth", "launch_s", "dispatch_s", "transfer_latency_s", "transfer_bandwidth"):
            _check_positive(f"{self.name} {field}", getattr(self, field))

    def peak(self, kind: str) -> float:
        """Peak FLOP/s of one kind of arithmetic; an error naming the kinds the model has when it lacks `kind`."""
        if kind not in self.peaks:
            raise ProjectionError(f"{self.name}: no peak for {kind!r}; it has {sorted(self.peaks)}")
        return self.peaks[kind]

    def transfer_s(self, nbytes: float) -> float:
        """Seconds of one host-device copy of `nbytes` (none for 0 bytes)."""
        return 0.0 if nbytes <= 0 else self.transfer_latency_s + nbytes / self.transfer_bandwidth

    def roofline_s(self, cost: ProgramCost) -> float:
        """The roofline alone: max(FLOPs / peak of the program's kind, bytes / bandwidth), no launches."""
        return max(cost.flops / self.peak(cost.kind), cost.nbytes / self.bandwidth)

    def device_s(self, cost: ProgramCost) -> float:
        """Seconds the device spends on one call: launches, the roofline, and the loop iterations' copies."""
        return cost.kernels * self.launch_s + self.roofline_s(cost) + cost.loop_trips * self.transfer_latency_s

    def queued_s(self, cost: ProgramCost) -> float:
        """Seconds per call when calls are queued back to back (throughput)."""
        return max(self.dispatch_s, self.device_s(cost))

    def request_s(self, cost: ProgramCost) -> float:
        """Seconds of one request from host memory back to host memory (latency)."""
        return self.dispatch_s + self.transfer_s(cost.h2d_bytes) + self.device_s(cost) + self.transfer_s(cost.d2h_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The parameters and their sources as plain JSON-ready values."""
        return dataclasses.asdict(self)
