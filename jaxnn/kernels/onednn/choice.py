"""Which oneDNN kernels jaxnn uses by default on this CPU: measured here once, cached per machine.

Whether oneDNN beats XLA's CPU kernels depends on the CPU: on the 2-core EPYCs measured (AVX-512 and AVX2-only)
its convolutions made the CNN's step 1.3-2.4x faster, while its bfloat16 products were no faster than XLA's, and
its float32 products gained on some shapes only (docs/performance.md, "Defaults per CPU"). So each kind of kernel
(`KINDS`: convolutions and matrix products, float32 and bfloat16 apart) is timed against XLA's path on shapes of
the benchmark models, in a child process (`python -m jaxnn.kernels.onednn.choice`; a trace must not run programs),
and taken where it takes at most `MARGIN` of XLA's time. The answer is cached under ~/.cache/jaxnn/onednn/, one file per
CPU model, core count, oneDNN and jax version; `JAXNN_ONEDNN=0/1` (or `jaxnn.kernels.onednn.use`) overrides it,
and `JAXNN_ONEDNN_CALIBRATE=0` skips the measurement (XLA's kernels then stay the default).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

KINDS = ("conv_f32", "conv_bf16", "matmul_f32", "matmul_bf16")
# oneDNN is chosen where its median time is below this fraction of XLA's. Not just any win: a float32 product
# measured at 0.71-0.89x XLA's gave the GPT's step no gain (docs/performance.md, "Defaults per CPU"), and a kernel
# brings OpenMP threads of its own along ("Threading").
MARGIN = 0.8
ENV_CALIBRATE = "JAXNN_ONEDNN_CALIBRATE"
TIMEOUT_S = 300
# Environment a measurement must not inherit: the switch itself and XLA flags that change what is compiled (the
# test suite's optimisation level 0, simulated devices).
_SCRUBBED = ("JAXNN_ONEDNN", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")


def cpu_signature() -> dict[str, Any]:
    """What decides the kernels' speed on this machine: CPU model and vector/matrix features, usable cores."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == (platform.processor() or platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    features = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "features": features, "cores": cores}


def _cache_path() -> str:
    import jax

    from jaxnn.kernels.onednn.library import version

    sig = {**cpu_signature(), "onednn": version(), "jax": jax.__version__}
    digest = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxnn", "onednn", f"choice-{digest}.json")


@functools.cache
def default_choices() -> dict[str, bool]:
    """{kind: whether it runs on oneDNN by default here}: the cached measurement, else a new one (once per machine,
    said on stderr), else none taken (the measurement failed or JAXNN_ONEDNN_CALIBRATE=0)."""
    import jax

    none = dict.fromkeys(KINDS, False)
    # A machine whose default backend is an accelerator lowers for it; its CPU's kernels are not worth a measurement.
    if jax.default_backend() != "cpu" or os.environ.get(ENV_CALIBRATE, "").strip().lower() in (
        "0",
        "false",
        "no",
        "off",
    ):
        return none
    path = _cache_path()
    record = _read(path)
    if record is None:
        print(f"jaxnn: timing oneDNN's kernels against XLA's on this CPU, once (cached in {path})", file=sys.stderr)
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        cmd = [sys.executable, "-m", "jaxnn.kernels.onednn.choice", "--write", path]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc = None
        record = _read(path)
        if record is None:
            why = "timed out" if proc is None else (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"jaxnn: the oneDNN measurement failed ({why}); XLA's kernels stay the default", file=sys.stderr)
            return none
    return {kind: bool(record["choices"].get(kind, False)) for kind in KINDS}


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record.get("choices"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def measure(repeats: int = 7) -> dict[str, Any]:
    """Times each kind of kernel against XLA's path in this process (not inside a trace) and returns the record
    `default_choices` caches: the medians in ms, the ratio oneDNN / XLA and the choice per kind."""
    from jaxnn.kernels.onednn import library
    from jaxnn.profile.timing import time_interleaved

    if not library.available():
        raise RuntimeError(library.unavailable_reason())
    rows: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        if kind.endswith("bf16") and not library.supports_bf16():
            rows[kind] = {"skipped": "oneDNN has no bfloat16 kernels for this CPU"}
            continue
        fns = {flag: _case(kind, flag) for flag in (False, True)}
        timing = time_interleaved({"xla": fns[False], "onednn": fns[True]}, repeats=repeats)
        xla_ms, onednn_ms = timing["xla"].median * 1e3, timing["onednn"].median * 1e3
        rows[kind] = {"xla_ms": xla_ms, "onednn_ms": onednn_ms, "ratio": onednn_ms / xla_ms}
    choices = {kind: "ratio" in row and row["ratio"] < MARGIN for kind, row in rows.items()}
    return {"cpu": cpu_signature(), "onednn": library.version(), "margin": MARGIN, "rows": rows, "choices": choices}


def _case(kind: str, on: bool):
    """A no-argument callable running one kind's forward and backward on the kernels (`on`) or XLA's path."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxnn import precision
    from jaxnn.kernels import onednn
    from jaxnn.layers import conv as conv_layer

    dtype = jnp.bfloat16 if kind.endswith("bf16") else jnp.float32
    rng = np.random.default_rng(0)
    if kind.startswith("conv"):  # the benchmark CNN's middle convolution: 64 x 16x16x32 -> 64
        shapes: tuple[tuple[int, ...], ...] = (64, 16, 16, 32), (3, 3, 32, 64)
        fn = conv_layer._conv_fn("onednn" if on else "im2col", (1, 1), "SAME", (1, 1), ("NHWC", "HWIO", "NHWC"), 1)
    else:  # the benchmark GPT's MLP product: 2048 tokens x 256 -> 1024
        shapes = (2048, 256), (256, 1024)
        fn = precision.dense
    x, w = (jnp.asarray(rng.standard_normal(shape) * 0.1, dtype) for shape in shapes)
    with onednn.use(on):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
        compiled = grad.lower(x, w).compile()
    return lambda: compiled(x, w)


def _write(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({**record, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=2)
    os.replace(tmp, path)  # atomic: processes measuring at once each leave a whole file


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxnn.kernels.onednn.choice", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE", help="write the record here (default: this machine's cache file)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing windows per kind")
    args = parser.parse_args(argv)
    record = measure(args.repeats)
    for kind, row in record["rows"].items():
        if "skipped" in row:
            print(f"{kind:12} skipped: {row['skipped']}")
        else:
            chosen = "oneDNN" if record["choices"][kind] else "XLA"
            times = f"XLA {row['xla_ms']:8.3f} ms  oneDNN {row['onednn_ms']:8.3f} ms  ({row['ratio']:.2f}x)"
            print(f"{kind:12} {times}: {chosen}")
    path = args.write or _cache_path()
    _write(path, record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
