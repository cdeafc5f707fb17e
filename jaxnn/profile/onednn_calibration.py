"""Measures which oneDNN kernels beat XLA's on this CPU and writes the record `choice.default_choices` caches.

    python -m jaxnn.profile.onednn_calibration [--write FILE] [--repeats 7]

jaxnn runs this in a child process at the first trace that asks for this machine's default (a trace must not run
programs); run by hand, it measures again and replaces this machine's cache file. It lives with the profiler, above
the layers and products it times (jaxnn's own CPU paths: im2col through `precision`, `precision.dense`), so that
the kernels' package imports nothing above `_src`: `choice` starts it by module name, never imports it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from jaxnn.kernels.onednn import library
from jaxnn.kernels.onednn.choice import KINDS, MARGIN, cache_path, cpu_signature, isa_caps


def measure(repeats: int = 7) -> dict[str, Any]:
    """Times each kind of kernel against XLA's path in this process (not inside a trace) and returns the record
    `default_choices` caches: the medians in ms, the ratio oneDNN / XLA and the choice per kind, and the
    instruction set caps it ran under."""
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
    record = {"cpu": cpu_signature(), "onednn": library.version(), "margin": MARGIN, "rows": rows, "choices": choices}
    return {**record, "isa_caps": isa_caps()}


def _case(kind: str, on: bool):
    """A no-argument callable running one kind's forward and backward on the kernels (`on`) or XLA's path."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxnn import precision
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
    with library.use(on):
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

    parser = argparse.ArgumentParser(
        prog="python -m jaxnn.profile.onednn_calibration", description=__doc__.splitlines()[0]
    )
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
    path = args.write or cache_path(library.version())
    _write(path, record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
