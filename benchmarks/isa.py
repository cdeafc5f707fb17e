"""A capped benchmark run: every library held to the same instruction set, to stand in for an older CPU's vectors.

    make bench-peers ISA=avx2            # or: python -m benchmarks.peers --isa avx2
    python -m benchmarks.ab_conv --isa avx2

Each library reads its own switch, once, when it loads: XLA's `--xla_cpu_max_isa` (in XLA_FLAGS), oneDNN's
`ONEDNN_MAX_CPU_ISA` (jaxnn's kernels and PyTorch's), PyTorch's `ATEN_CPU_CAPABILITY`. So a cap is an environment
a process must start with: `capped_env` builds it for each child process `benchmarks.peers` starts, and
`restart_capped` re-executes a one-process benchmark under it. XLA's YNNPACK kernels have no switch (they read
the CPU's feature bits themselves): `capped_command` starts a capped process inside gdb, which holds them to AVX2
(benchmarks/ynn_avx2.gdb), where gdb is installed. What a capped figure does and does not stand for:
docs/performance.md, "Capped runs".
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping

NATIVE = "native"
# Per cap, the switch of each library, as that library spells it.
CAPS: dict[str, dict[str, str]] = {
    "avx2": {"xla": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
XLA_FLAG = "--xla_cpu_max_isa"
# Set in a capped process so that a restart happens once, and so that labels can name the cap.
ENV_CAP = "JAXNN_BENCH_ISA"


def add_isa_flag(parser: argparse.ArgumentParser) -> None:
    """`--isa {native,avx2}`: the instruction set every library may use (default: all this CPU has)."""
    parser.add_argument(
        "--isa",
        choices=[NATIVE, *CAPS],
        default=os.environ.get(ENV_CAP, NATIVE) or NATIVE,
        help="cap every library's instruction set (XLA, oneDNN, PyTorch) the same way; default: native "
        "(make bench-peers ISA=avx2 passes it)",
    )


def capped_env(isa: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with every library's switch set to `isa`; XLA's flag is
    added to the XLA_FLAGS already there, replacing an earlier cap. `native` removes the caps."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(XLA_FLAG + "=")]
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", ENV_CAP):
        env.pop(name, None)
    if isa != NATIVE:
        switches = CAPS[isa]
        flags.append(f"{XLA_FLAG}={switches['xla']}")
        env.update({k: v for k, v in switches.items() if k != "xla"})
        env[ENV_CAP] = isa
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


YNN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ynn_avx2.gdb")


def capped_command(isa: str, argv: list[str]) -> list[str]:
    """The command line that starts `argv` under `isa`: for a cap, inside gdb running `YNN_SCRIPT`, which holds
    XLA's YNNPACK kernels to AVX2 as well (gdb's exit status is the program's); `argv` itself natively, or where
    gdb is not installed (then YNNPACK keeps every instruction this CPU has: `cap_label` says so)."""
    gdb = shutil.which("gdb")
    if isa == NATIVE or gdb is None:
        return list(argv)
    # auto-load off: else gdb declines the interpreter's own gdb helpers in a warning every capped run prints
    return [gdb, "-q", "-batch", "-iex", "set auto-load off", "-return-child-result", "-x", YNN_SCRIPT, "--args", *argv]


def active_cap() -> str | None:
    """The cap this process runs under (None: native): set by `capped_env`, so the label matches the switches."""
    return os.environ.get(ENV_CAP) or None


def restart_capped(isa: str) -> None:
    """Re-executes this process's command line under `capped_env(isa)` unless it already runs so: call it first
    thing in `main`, before any library runs a program (the switches are read once, at load)."""
    if (active_cap() or NATIVE) == isa:
        return
    env = capped_env(isa)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = capped_command(isa, [sys.executable, *sys.orig_argv[1:]])
    os.execve(argv[0], argv, env)


def cap_label(isa: str | None = None) -> str:
    """ "capped to AVX2" under a cap, "" natively: what table headers and JSON records carry."""
    isa = active_cap() if isa is None else (None if isa == NATIVE else isa)
    if not isa:
        return ""
    return f"capped to {CAPS[isa]['xla']}" + ("" if shutil.which("gdb") else " (not YNNPACK: no gdb)")
