"""The block a run starts with, saying what its levers do: trainable and frozen parameters, the packing efficiency,
the remat policy and the compiled step's temporary memory (XLA's memory analysis), whether the precision pays on
this backend, and the clip norm. Logged on `jaxnn.levers` (which `jaxnn train` shows) and kept as summary.json's
"levers". Internal to `jaxnn.loop`.

The precision rule is a measurement of jax's CPU backend (docs/precision.md): bf16 products run faster than fp32
only where the CPU has bf16 dot-product instructions (avx512_bf16 or amx_bf16), and no CPU has fp8 units: fp8's
products are quantised and then multiplied in bf16, so fp8 runs slower than bf16 on any CPU (and than fp32 on a
GPT step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jaxnn._src.cpu import BF16_FLAGS, cpu_info, usable_flags
from jaxnn._src.warn import warn_at_caller
from jaxnn.errors import PrecisionWarning

log = logging.getLogger("jaxnn.levers")

# fp8's speed on a CPU as a fraction of bf16's and fp32's: an MLP and a GPT train step (docs/precision.md)
FP8_CPU_SPEED = "0.48x and 0.52x bf16's speed, 1.37x and 0.71x fp32's, on an MLP and a GPT step"
# bf16's and fp16's GPT step time against fp32's on CPUs without their instructions (docs/precision.md)
BF16_WIDENED_TIME = "1.07-1.12x fp32's time on a GPT step with AVX2 only"
FP16_CPU_TIME = "1.16-1.25x fp32's time on a GPT step"
FP16_FLAGS = ("avx512_fp16", "amx_fp16")  # CPU instructions that multiply fp16 values themselves
# fp8 on a GPU: on an H200 (2026-12-04) the 304M GPT's step (d 1024) was no faster in fp8 than in bf16, and bare
# fp8 GEMMs beat bf16's only from 8192^3 (1.26x), not at 4096^3: per-tensor scaling's passes over each operand cost
# what the narrower products save. Below this width a run is told so.
FP8_GPU_MIN_WIDTH = 4096
FP8_GPU_SPEED = "the 304M GPT (d 1024) step 86.29 ms against bf16's 85.64 on an H200; bare GEMMs faster from 8192^3"


def precision_advice(precision: str, backend: str, flags: frozenset[str], width: int | None = None) -> str | None:
    """Why `precision` does not pay on this backend (a CPU with these feature `flags`; `width`: how wide the
    model's products are, `product_width`), or None where it may."""
    if backend == "gpu" and precision.startswith("fp8") and width is not None and width < FP8_GPU_MIN_WIDTH:
        return (
            f"precision {precision} with products {width} wide: fp8 has measured no faster than bf16 below "
            f"{FP8_GPU_MIN_WIDTH} ({FP8_GPU_SPEED}); use bf16 for this model"
        )
    if backend != "cpu" or precision in ("fp32", "tf32"):
        return None
    if precision.startswith("fp8"):
        return (
            f"precision {precision} on a CPU: no CPU has fp8 units, so its products are quantised and then "
            f"multiplied in bf16: slower than bf16 (measured {FP8_CPU_SPEED}); use bf16 where the CPU has "
            f"{' or '.join(BF16_FLAGS)}, else fp32"
        )
    if precision == "bf16" and not any(flag in flags for flag in BF16_FLAGS):
        return (
            f"precision bf16 on a CPU without {' or '.join(BF16_FLAGS)}: its products run as float32 products of "
            f"the widened values here, so a step is slower than fp32's (measured {BF16_WIDENED_TIME}); use fp32 "
            "on this machine"
        )
    if precision == "fp16" and not any(flag in flags for flag in FP16_FLAGS):
        return (
            f"precision fp16 on a CPU without {' or '.join(FP16_FLAGS)}: no instruction here multiplies fp16 values, "
            f"and a step is slower than fp32's (measured {FP16_CPU_TIME}); use fp32 on this machine"
        )
    return None


def parameter_counts(params: Any, lora: bool) -> tuple[int, int]:
    """(trainable, frozen) parameters: a LoRA run trains its adapters alone (their scales are constants, counted
    in neither); a quantised base counts its weights' parameters, not its stored bytes."""
    from jaxnn.fp8 import without_histories
    from jaxnn.quantized import parameter_count

    params = without_histories(params)  # fp8-delayed's amax histories are neither trained nor the model's
    total = parameter_count(params)
    if not lora:
        return total, 0
    from jaxnn.lora import adapters

    sizes = {name: int(np.size(leaf)) for name, leaf in adapters(params).items()}
    trained = sum(n for name, n in sizes.items() if not name.endswith("lora_scale"))
    return trained, total - sum(sizes.values())  # frozen: the base's own parameters


def product_width(params: Any) -> int:
    """How wide the model's products are: the narrower side of its widest 2-D (or stacked 2-D) weight (a GPT's
    d_model, an N x N x N product's N)."""
    return max((min(np.shape(leaf)[-2:]) for leaf in jax.tree.leaves(params) if np.ndim(leaf) >= 2), default=0)


def packing_efficiency(data: Any) -> float | None:
    """Real tokens per window position of packed data (a dict with `segment_ids`, 0 marking padding), or None."""
    if isinstance(data, dict) and "segment_ids" in data:
        return float(np.mean(np.asarray(data["segment_ids"]) != 0))
    return None


def remat_of(policy: str | None, model: Any) -> str | None:
    """The remat policy the run trains under: fit's `remat`, or the one the model's config holds (`--remat`)."""
    if policy is not None:
        return policy
    spec = getattr(model, "spec", None)
    config = spec.args[0] if spec is not None and len(spec.args) == 1 else None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        found = getattr(config, "remat", False)
        return "nothing" if found is True else (found or None)
    return None


def clip_of(clip_norm: float | None, default_optimizer: bool, optimizer_id: dict) -> float | None:
    """The global-norm clip: the default optimizer's `clip_norm`, else the one found in the given optimizer's
    settings (`jaxnn._src.optimizer_id`), else None (no clipping)."""
    if default_optimizer:
        return clip_norm or None
    for name, value in optimizer_id.get("settings", {}).items():
        if name.endswith("clip_by_global_norm.max_norm") and isinstance(value, (int, float)):
            return float(value)
    return None


class Levers:
    """What the run's levers are (`record`), said once the step is compiled (`announce`)."""

    def __init__(self, cfg: Any, model: Any, params: Any, data: Any, inputs: Any, optimizer_id: dict):
        trainable, frozen = parameter_counts(params, inputs.lora is not None)
        flags = usable_flags(cpu_info()[1])  # as XLA_FLAGS' --xla_cpu_max_isa leaves them
        advice = precision_advice(cfg.precision, jax.default_backend(), flags, product_width(params))
        self.record: dict[str, Any] = {
            "trainable_params": trainable,
            "frozen_params": frozen,
            "packing_efficiency": packing_efficiency(data),
            "remat": remat_of(cfg.remat, model),
            "step_temp_bytes": None,
            "precision": cfg.precision,
            "precision_pays": advice is None,
            "precision_warning": advice,
            "clip_norm": clip_of(cfg.clip_norm, inputs.optimizer is None, optimizer_id),
        }

    def announce(self, dp: Any, state: Any, batch: Any) -> None:
        """Measures the compiled step's temporary memory (the compile is the one the first step reuses), then logs
        the block and warns where the precision does not pay."""
        memory = getattr(dp, "temp_bytes", None)
        if memory is not None:
            with contextlib.suppress(Exception):  # an analysis the backend lacks leaves the figure out
                self.record["step_temp_bytes"] = memory(state, batch)
        for line in lines(self.record):
            log.info("%s", line)
        if self.record["precision_warning"]:
            warn_at_caller(self.record["precision_warning"], PrecisionWarning)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def lines(record: dict) -> list[str]:
    """The block's lines for a `Levers.record`."""
    r = record
    total = r["trainable_params"] + r["frozen_params"]
    packing = "n/a (not packed)" if r["packing_efficiency"] is None else f"{100 * r['packing_efficiency']:.1f}%"
    memory = "n/a" if r["step_temp_bytes"] is None else _size(r["step_temp_bytes"])
    pays = "pays on this backend" if r["precision_pays"] else "does NOT pay on this backend (see the warning)"
    return [
        f"parameters {r['trainable_params']:,} trainable, {r['frozen_params']:,} frozen "
        f"({100 * r['trainable_params'] / max(total, 1):.2f}% trained)",
        f"packing efficiency {packing}",
        f"remat {r['remat'] or 'off'}; compiled step's temporary memory {memory} (XLA memory analysis)",
        f"precision {r['precision']}: {pays}",
        f"clip norm {r['clip_norm'] if r['clip_norm'] is not None else 'off'} (global norm of the gradients)",
    ]
