"""The CNN's training step with and without the oneDNN kernels, idle and with a busy loop on one core.

    python -m benchmarks.onednn_load [--precisions fp32 bf16] [--repeats 5]

oneDNN runs on OpenMP threads of its own, whose static schedule waits for the slowest thread; XLA's thread pool
shares out work as threads free up. This times both paths in one process (interleaved windows) with the machine
idle and then with another process spinning on one core, to see whether the kernels keep their lead when a core
is taken. Set OMP_WAIT_POLICY to compare OpenMP's wait policies.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def steps(precision: str) -> dict:
    from benchmarks.peers.peer_jaxnn import build
    from jaxnn.kernels import onednn

    out = {}
    for label, flag in (("xla", False), ("onednn", True)):
        with onednn.use(flag):  # read when tracing: the first call traces here
            step = build("cnn", precision)
            step()
        out[label] = step
    return out


def main(argv=None) -> int:
    from benchmarks.machine import cpu_label
    from jaxnn.kernels import onednn
    from jaxnn.profile.timing import time_interleaved

    parser = argparse.ArgumentParser(prog="python -m benchmarks.onednn_load", description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not onednn.available():
        sys.exit(f"benchmarks.onednn_load: {onednn.unavailable_reason()}")
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    for precision in args.precisions:
        if precision == "bf16" and not onednn.supports_bf16():
            print("bf16: oneDNN has no bfloat16 kernels for this CPU; skipped")
            continue
        fns = steps(precision)
        for load in ("idle", "busy loop on one core"):
            spinner = None
            if load != "idle":
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(1)
            try:
                timing = time_interleaved(fns, repeats=args.repeats)
            finally:
                if spinner is not None:
                    spinner.kill()
            cells = ", ".join(f"{k} {t.median * 1e3:.1f} ms" for k, t in timing.items())
            print(f"CNN {precision}, {load}, OMP_WAIT_POLICY={policy}: {cells}", flush=True)
    print(f"measured on {cpu_label()}; median of {args.repeats} interleaved windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
