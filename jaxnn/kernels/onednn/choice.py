"""Which oneDNN kernels jaxnn uses by default on this CPU: measured here once, cached per machine.

Whether oneDNN beats XLA's CPU kernels depends on the CPU: on the 2-core EPYCs measured (AVX-512 and AVX2-only)
its convolutions made the CNN's step 1.3-2.4x faster, while its bfloat16 products were no faster than XLA's, and
its float32 products gained on some shapes only (docs/performance.md, "Defaults per CPU"). So each kind of kernel
(`KINDS`: convolutions and matrix products, float32 and bfloat16 apart) is timed against XLA's path on shapes of
the benchmark models, in a child process (`python -m jaxnn.profile.onednn_calibration`; a trace must not
run programs), and taken where it takes at most `MARGIN` of XLA's time. The answer is cached under
~/.cache/jaxnn/onednn/, one file per CPU model and features, core count, oneDNN and jax version, and instruction
set cap (`ONEDNN_MAX_CPU_ISA`, XLA's `--xla_cpu_max_isa`: a capped process measures, and keeps, its own answer);
`JAXNN_ONEDNN=0/1` (or `jaxnn.kernels.onednn.use`) overrides it, and `JAXNN_ONEDNN_CALIBRATE=0` skips the
measurement (XLA's kernels then stay the default).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from typing import Any

from jaxnn._src.cpu import cpu_info

KINDS = ("conv_f32", "conv_bf16", "matmul_f32", "matmul_bf16")
# oneDNN is chosen where its median time is below this fraction of XLA's. Not just any win: a float32 product
# measured at 0.71-0.89x XLA's gave the GPT's step no gain (docs/performance.md, "Defaults per CPU"), and a kernel
# brings OpenMP threads of its own along ("Threading").
MARGIN = 0.8
ENV_CALIBRATE = "JAXNN_ONEDNN_CALIBRATE"
TIMEOUT_S = 300
# Environment a measurement must not inherit: the switch itself and XLA flags that change what is compiled (the
# test suite's optimisation level 0, simulated devices). XLA's instruction set cap is kept (`isa_caps`).
_SCRUBBED = ("JAXNN_ONEDNN", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")
XLA_ISA_FLAG = "--xla_cpu_max_isa"
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def isa_caps(env: dict[str, str] | None = None) -> dict[str, str]:
    """The instruction set caps this process runs under, by library ({} natively): {"xla": "AVX2", "onednn":
    "AVX2"}, from XLA_FLAGS' `--xla_cpu_max_isa` and oneDNN's `ONEDNN_MAX_CPU_ISA` (or its older name)."""
    env = dict(os.environ) if env is None else env
    caps = {}
    for flag in env.get("XLA_FLAGS", "").split():
        if flag.startswith(XLA_ISA_FLAG + "="):
            caps["xla"] = flag.split("=", 1)[1].upper()  # the last one given wins, as in XLA's parser
    onednn = next((env[name] for name in ONEDNN_ISA_ENV if env.get(name)), None)
    if onednn:
        caps["onednn"] = onednn.upper()
    return caps


def cpu_signature() -> dict[str, Any]:
    """What decides the kernels' speed on this machine: CPU model and vector/matrix features, usable cores."""
    model, flags, cores = cpu_info()
    features = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return {"model": model or platform.processor() or platform.machine(), "features": features, "cores": cores}


def cache_path(onednn_version: str | None) -> str:
    """This machine's cache file for the kernels of `onednn_version`, under this process's instruction set caps."""
    import jax

    sig = {**cpu_signature(), "onednn": onednn_version, "jax": jax.__version__}
    caps = isa_caps()
    if caps:  # only then: an uncapped machine keeps the file it measured before caps were part of the key
        sig["isa_caps"] = caps
    digest = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxnn", "onednn", f"choice-{digest}.json")


@functools.cache
def default_choices(onednn_version: str | None = None) -> dict[str, bool]:
    """{kind: whether it runs on oneDNN by default here}: the cached measurement, else a new one (once per machine,
    said on stderr), else none taken (the measurement failed or JAXNN_ONEDNN_CALIBRATE=0)."""
    import jax

    none = dict.fromkeys(KINDS, False)
    # A machine whose default backend is an accelerator lowers for it; its CPU's kernels are not worth a measurement.
    skipped = os.environ.get(ENV_CALIBRATE, "").strip().lower() in ("0", "false", "no", "off")
    if skipped or jax.default_backend() != "cpu":
        return none
    path = cache_path(onednn_version)
    record = _read(path)
    if record is None:
        print(f"jaxnn: timing oneDNN's kernels against XLA's on this CPU, once (cached in {path})", file=sys.stderr)
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        if "xla" in isa_caps():  # the measurement compares kernels under the caps the caller runs with
            env["XLA_FLAGS"] = f"{XLA_ISA_FLAG}={isa_caps()['xla']}"
        # By module name, not imported: the measurement times the layers and products above this package.
        cmd = [sys.executable, "-m", "jaxnn.profile.onednn_calibration", "--write", path]
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
