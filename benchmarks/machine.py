"""Which CPU a figure came from: its model name and the matrix/bf16 instruction sets XLA and oneDNN can use."""

from __future__ import annotations

import os
import platform

from benchmarks.isa import cap_label

FEATURES = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f")


def cpu_label(isa: str | None = None) -> str:
    """E.g. "Intel(R) Xeon(R) Processor, 2 cores, AMX-BF16 AMX-INT8 AVX512-BF16" (from /proc/cpuinfo), with
    ", capped to AVX2" where `isa` (default: this process's cap, benchmarks/isa.py) caps the libraries."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    have = [f.upper().replace("_", "-") for f in FEATURES if f in flags]
    # avx512f is implied by the others; name it only when it is the best there is.
    if len(have) > 1:
        have = [f for f in have if f != "AVX512F"]
    capped = cap_label(isa)
    return f"{name}, {cores} cores" + (f", {' '.join(have)}" if have else "") + (f", {capped}" if capped else "")
