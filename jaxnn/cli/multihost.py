"""A local launcher for multi-process runs: N `jaxnn train` processes on 127.0.0.1 that train one model together.

    python -m jaxnn.cli.multihost --num-processes 2 -- --model mlp --steps 300     # what `make train-multihost` runs

Each worker is `jaxnn train --coordinator ... --num-processes N --process-id i` (the same loop as any run); they
form one mesh over gloo, each loads its own rows of every global batch, and process 0 writes the run directory.
On a cluster, start one `jaxnn train` per host yourself with those flags (or JAXNN_* variables, or --cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from jaxnn.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE

# What `jaxnn train` prints last in a multi-process run.
RESULT_LINE = re.compile(
    r"jaxnn: process (?P<process>\d+) of (?P<processes>\d+) \((?P<devices>\d+) devices\): "
    r"step (?P<step>\d+), params (?P<params>[0-9a-f]+)"
)
DEFAULT_TRAIN_ARGS = ["--model", "mlp", "--steps", "300", "--batch-size", "64", "--no-progress", "--no-plots"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class WorkerResult:
    process_id: int
    returncode: int | None  # None: killed by the launcher
    stdout: str
    stderr: str
    result: dict | None  # the worker's final line: process, processes, devices, step, params


def launch_local(
    num_processes: int,
    train_args: list[str],
    *,
    devices_per_process: int = 1,
    timeout_s: float = 600,
    grace_s: float = 30,
) -> list[WorkerResult]:
    """Starts `num_processes` `jaxnn train` workers (with `train_args`) on 127.0.0.1 and waits for them; never hangs.

    When a worker fails, the others get `grace_s` to stop on their own (jax's heartbeat ends them) before
    they are killed; every worker is killed after `timeout_s`.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the device count comes from --devices-per-process
    with tempfile.TemporaryDirectory(prefix="jaxnn-multihost-") as logs, contextlib.ExitStack() as files:
        procs, outputs = [], []
        for i in range(num_processes):
            out = files.enter_context(open(f"{logs}/{i}.out", "w+"))
            err = files.enter_context(open(f"{logs}/{i}.err", "w+"))
            outputs.append((out, err))
            cmd = [
                sys.executable,
                "-m",
                "jaxnn.cli",
                "train",
                *train_args,
                "--coordinator",
                coordinator,
                "--num-processes",
                str(num_processes),
                "--process-id",
                str(i),
                "--devices",
                str(devices_per_process),
            ]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
        _wait_all(procs, timeout_s, grace_s)
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            reports = [m.groupdict() for m in map(RESULT_LINE.match, stdout.splitlines()) if m]
            results.append(WorkerResult(i, p.returncode, stdout, stderr, reports[-1] if reports else None))
    return results


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, grace_s: float) -> None:
    """Waits for every process; kills the rest `grace_s` after one failed, and all after `timeout_s`."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace_s):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    p.returncode = None  # None: killed by the launcher
            return
        time.sleep(0.2)


def failure_reason(stderr: str) -> str:
    """The line of a failed worker's stderr that says why (jax's fatal-error line, the watchdog, a traceback's end)."""
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip() and not line.lstrip().startswith(("@", "***", "[Gloo]"))
    ]
    for marker in ("Terminating process because", "jaxnn:", "Error"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else "(no output)"


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxnn.cli.multihost",
        description=__doc__.splitlines()[0],
        epilog="Arguments after -- go to every `jaxnn train` worker (default: " + " ".join(DEFAULT_TRAIN_ARGS) + ").",
    )
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices in each process")
    p.add_argument("--run-dir", default=None, help="the run directory (default runs/multihost/<time>)")
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=10,
        help="seconds after which a silent process counts as dead and the others stop",
    )
    p.add_argument("--timeout", type=float, default=900, help="kill every worker after this many seconds")
    p.add_argument("train_args", nargs="*", help="arguments for `jaxnn train` (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.num_processes < 1 or args.devices_per_process < 1:
        print("jaxnn.cli.multihost: error: --num-processes and --devices-per-process must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    run_dir = args.run_dir or os.path.join("runs", "multihost", time.strftime("%Y%m%d-%H%M%S"))
    train_args = [
        *(args.train_args or DEFAULT_TRAIN_ARGS),
        "--run-dir",
        run_dir,
        "--heartbeat-timeout",
        str(args.heartbeat_timeout),
    ]
    t0 = time.monotonic()
    results = launch_local(
        args.num_processes,
        train_args,
        devices_per_process=args.devices_per_process,
        timeout_s=args.timeout,
        grace_s=args.heartbeat_timeout + 20,
    )
    print(
        f"{args.num_processes} processes x {args.devices_per_process} CPU device(s) on 127.0.0.1, "
        f"{time.monotonic() - t0:.1f} s -> {run_dir}"
    )
    for r in results:
        if r.result:
            print(
                f"  process {r.process_id} of {r.result['processes']} ({r.result['devices']} devices in the mesh): "
                f"step {r.result['step']} params {r.result['params']}"
            )
        else:
            print(f"  process {r.process_id}: failed (exit {r.returncode}): {failure_reason(r.stderr)}")
    reports = [r.result for r in results if r.returncode == 0 and r.result]
    if len(reports) == len(results):
        summary = [line for line in results[0].stdout.splitlines() if " -> " in line]
        if summary:
            print("  " + summary[-1])
        same = len({report["params"] for report in reports}) == 1
        print("params identical on every process" if same else "PARAMS DIFFER between processes")
        return EXIT_OK if same else EXIT_FAILED
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
