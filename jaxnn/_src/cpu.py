"""This machine's CPU as /proc/cpuinfo and the scheduler tell it: model name, feature flags, usable cores."""

from __future__ import annotations

import functools
import os
import pathlib
import re


def cpu_info() -> tuple[str | None, frozenset[str], int]:
    """(model name or None, the feature flags, the cores this process may run on); no model and no flags where
    /proc/cpuinfo is unreadable (not Linux)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, frozenset(), cores
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.MULTILINE)
    return (model.group(1).strip() if model else None), frozenset(flags.group(1).split() if flags else ()), cores


# CPU instructions that multiply bf16 values themselves (dot products of bf16 pairs into float32). Without them,
# XLA's CPU libraries still take a bf16 x bf16 -> f32 product, but widen the bf16 values inside their kernels.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# XLA's `--xla_cpu_max_isa` values, oldest first (XLA's own help text), and the first that allows bf16 products.
XLA_ISAS = ("SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX", "AMX_FP16")
_FIRST_BF16_ISA = XLA_ISAS.index("AVX512_BF16")


def xla_isa_cap(xla_flags: str | None = None) -> str | None:
    """The instruction set XLA's CPU backend is held to by `--xla_cpu_max_isa` in `xla_flags` (default: this
    process's XLA_FLAGS), upper-cased; None where no cap is set (the last one counts, as in XLA)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    caps = [f.split("=", 1)[1].strip().upper() for f in flags.split() if f.startswith("--xla_cpu_max_isa=")]
    return (caps[-1] or None) if caps else None


def bf16_products(flags: frozenset[str] | None = None, xla_flags: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 values itself (`BF16_FLAGS`), as XLA may use it: `flags` default to
    /proc/cpuinfo's, and a `--xla_cpu_max_isa` cap in `xla_flags` (default: XLA_FLAGS) below AVX512_BF16 counts
    as their absence. True where the flags cannot be read (not Linux): the products are then left as they are."""
    if flags is None:
        flags = cpu_info()[1]
        if not flags:
            return True
    return any(flag in usable_flags(flags, xla_flags) for flag in BF16_FLAGS)


def usable_flags(flags: frozenset[str], xla_flags: str | None = None) -> frozenset[str]:
    """`flags` less `BF16_FLAGS` where `--xla_cpu_max_isa` in `xla_flags` (default: XLA_FLAGS) holds XLA below
    AVX512_BF16: the features XLA may use. (A cap only lowers XLA's own code and jaxnn's choices: XLA's YNNPACK
    kernels pick their instructions by themselves, docs/performance.md, "Capped runs".)"""
    cap = xla_isa_cap(xla_flags)
    if cap is not None and cap in XLA_ISAS and XLA_ISAS.index(cap) < _FIRST_BF16_ISA:
        return flags - frozenset(BF16_FLAGS)
    return flags


@functools.cache
def host_bf16_products() -> bool:
    """`bf16_products()` for this process, read once: XLA reads its flags once too, when it starts."""
    return bf16_products()
