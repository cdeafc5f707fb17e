"""`make bench-peers`: runs jaxnn and every peer, each in its own process, and prints one table of step times
with each peer's ratio to jaxnn (peer ms / jaxnn ms: above 1 means jaxnn is faster); writes the JSON.

`--isa avx2` (`make bench-peers ISA=avx2`) caps every library's instruction set the same way, through each
child process's environment (benchmarks/isa.py); the table header and the JSON say so.

With `--rounds N` the whole sequence runs N times, interleaved, and each figure is the median over rounds, so a
burst of load from other processes on this shared machine does not land on one library only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.isa import NATIVE, add_isa_flag, cap_label, capped_command, capped_env
from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing
from benchmarks.train_steps import PRECISIONS, SPECS

PEERS = {
    "jaxnn": "peer_jaxnn",
    "jaxnn_metrics": "peer_jaxnn_metrics",
    "jaxnn_onednn": "peer_jaxnn_onednn",
    "jaxnn_xla": "peer_jaxnn_xla",
    "jaxnn_xla_attention": "peer_jaxnn_xla_attention",
    "jaxnn_system_malloc": "peer_jaxnn_system_malloc",
    "jaxnn_one_arena": "peer_jaxnn_one_arena",
    "flax_linen": "peer_linen",
    "flax_nnx": "peer_nnx",
    "equinox": "peer_equinox",
    "haiku": "peer_haiku",
    "pytorch": "peer_torch",
}
JAX_PEERS = ("flax_linen", "flax_nnx", "equinox", "haiku")
# Peers that run no XLA program: their capped processes start without gdb, which holds only XLA's YNNPACK kernels
# (`benchmarks.isa.capped_command`); PyTorch's kernels follow ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA.
NO_XLA_PEERS = ("pytorch",)


def run_peer(library: str, models, precisions, repeats: int, isa: str = NATIVE) -> dict:
    """One library's rows, measured in a child process started with `isa`'s caps in its environment."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        "-m",
        f"benchmarks.peers.{PEERS[library]}",
        "--out",
        out,
        "--repeats",
        str(repeats),
        "--models",
        *models,
        "--precisions",
        *precisions,
    ]
    cmd = cmd if library in NO_XLA_PEERS else capped_command(isa, cmd)
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=capped_env(isa))
    try:
        if proc.returncode:
            return {"library": library, "rows": [], "error": proc.stderr.strip().splitlines()[-1:]}
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def collect(results: list[dict]) -> dict:
    """{(library, model, precision): median step ms over rounds (None when it failed)}."""
    times: dict = {}
    for res in results:
        for row in res["rows"]:
            times.setdefault((row["library"], row["model"], row["precision"]), []).append(row.get("step_ms"))
    return {
        k: (statistics.median([v for v in vs if v is not None]) if any(v is not None for v in vs) else None)
        for k, vs in times.items()
    }


def format_table(times: dict, libraries, models, precisions, isa: str = NATIVE) -> str:
    head = f"{'model':6} {'prec':5} {'jaxnn ms':>9} " + " ".join(f"{lib:>19}" for lib in libraries if lib != "jaxnn")
    title = "step time, median ms per step; in brackets the ratio peer/jaxnn (> 1: jaxnn is faster)"
    capped = cap_label(isa)
    if capped:
        title = f"{capped.upper()} (XLA, oneDNN and PyTorch alike), {title}"
    lines = [title, head]
    for model in models:
        for prec in precisions:
            ref = times.get(("jaxnn", model, prec))
            cells = []
            for lib in libraries:
                if lib == "jaxnn":
                    continue
                t = times.get((lib, model, prec))
                cells.append(
                    f"{'-':>19}" if t is None else f"{t:9.4g} ({t / ref:5.2f}x)" if ref else f"{t:9.4g}        "
                )
            lines.append(f"{model:6} {prec:5} {('-' if ref is None else f'{ref:.4g}'):>9} " + " ".join(cells))
    return "\n".join(lines)


def format_kernels(results: list[dict]) -> str:
    """One line per jaxnn row: the kernels its convolutions and products ran on (as each row's process traced)."""
    seen: dict = {}
    for res in results:
        for row in res["rows"]:
            if row.get("kernels"):
                seen.setdefault((row["library"], row["model"], row["precision"]), row["kernels"])
    return "\n".join(f"kernels: {lib} {model} {prec}: {k}" for (lib, model, prec), k in seen.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS))
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="timing windows per configuration")
    parser.add_argument("--quick", action="store_true", help="3 windows, tiny and mlp only unless --models is given")
    add_isa_flag(parser)
    add_json_flags(parser, "default: results/bench/peers[-avx2]-<UTC time>.json")
    args = parser.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)
    if args.quick:
        args.repeats = 3
        if "--models" not in (argv or sys.argv):
            args.models = ["tiny", "mlp"]
    libraries = ["jaxnn", *[p for p in args.peers if p != "jaxnn"]]
    results = []
    for r in range(args.rounds):
        for lib in libraries:
            t0 = time.perf_counter()
            res = run_peer(lib, args.models, args.precisions, args.repeats, args.isa)
            res["round"] = r
            results.append(res)
            print(
                f"round {r + 1}/{args.rounds}: {lib} done in {time.perf_counter() - t0:.0f} s"
                + (f" (failed: {res['error']})" if res.get("error") else ""),
                file=sys.stderr,
            )
    times = collect(results)
    print(format_table(times, libraries, args.models, args.precisions, args.isa))
    print(format_kernels(results))
    print(f"measured on {cpu_label(args.isa)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    name = "peers" + ("" if args.isa == NATIVE else f"-{args.isa}")
    path = args.json or os.path.join("results", "bench", time.strftime(f"{name}-%Y%m%dT%H%M%SZ.json", time.gmtime()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "cpu_count": os.cpu_count(),
                "cpu": cpu_label(args.isa),
                "isa": args.isa,
                "capped": cap_label(args.isa) or None,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "median_ms": [
                    {"library": k[0], "model": k[1], "precision": k[2], "step_ms": v} for k, v in sorted(times.items())
                ],
                "runs": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
