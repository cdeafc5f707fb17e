"""Multi-process data-parallel training on the bundled digits, and a launcher that starts the processes locally.

    python -m jaxnn.multihost --num-processes 2            # two local CPU processes on 127.0.0.1 train together

Each worker joins the run with `jaxnn.parallel.initialize_distributed`, loads only its own rows of every global
batch, and steps with `jaxnn.parallel.data_parallel_train_step`; checkpoints are written and read by all processes
through orbax. On a cluster, start one worker per host yourself (`--worker` with `--coordinator`,
`--num-processes`, `--process-id`, or the JAXNN_* environment variables, or nothing under SLURM).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

RESULT_TAG = "JAXNN_RESULT "


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One data-parallel run on the digits; the global batches depend only on (seed, step)."""

    model: str = "mlp"        # "mlp" or "cnn", in their small() configurations
    steps: int = 300
    global_batch: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    form: str = "jit"         # see jaxnn.parallel.FORMS ("pmap" is single-process only)

    def small(self) -> "RunConfig":
        return dataclasses.replace(self, steps=6, global_batch=16)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 8x8 sklearn digits as (N, 8, 8, 1) float32 images in [0, 1] and int32 labels."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return (digits.images[..., None] / 16.0).astype(np.float32), digits.target.astype(np.int32)


def batch_indices(cfg: RunConfig, step: int, num_examples: int) -> np.ndarray:
    """The rows of global batch `step`: a fixed function of (seed, step), so resumed and split runs see the same."""
    return np.random.default_rng([cfg.seed, step]).choice(num_examples, cfg.global_batch, replace=False)


def _model(name: str):
    from jaxnn.models import CONFIGS, get_model

    if name not in ("mlp", "cnn"):
        raise ValueError(f"multihost: model must be 'mlp' or 'cnn', got {name!r}")
    return get_model(name, CONFIGS[name]().small())


def checkpoint_manager(directory: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def save_state(directory: str, state) -> None:
    """Writes `state` (replicated over the mesh) at its step; every process must call this."""
    import orbax.checkpoint as ocp

    with checkpoint_manager(directory) as manager:
        manager.save(int(np.asarray(state.step.addressable_data(0))), args=ocp.args.StandardSave(state))
        manager.wait_until_finished()


def restore_state(directory: str, like):
    """The latest state in `directory`, placed with the shardings of `like` (whatever process count wrote it)."""
    import jax
    import orbax.checkpoint as ocp

    with checkpoint_manager(directory) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"restore_state: no checkpoint in {directory}")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        return manager.restore(step, args=ocp.args.StandardRestore(target))


def local_value(x) -> np.ndarray:
    """This process's copy of a replicated array (np.asarray refuses arrays that span processes)."""
    return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else np.asarray(x)


def params_digest(params) -> str:
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(local_value(leaf).tobytes())
    return h.hexdigest()[:16]


def train(cfg: RunConfig, *, mesh=None, checkpoint_dir: str | None = None, restore_dir: str | None = None,
          on_step: Callable[[int], None] | None = None, log_every: int = 50, until: int | None = None):
    """Trains `cfg` data-parallel over `mesh` (all devices of all processes by default); returns (state, loss).

    `until` stops early at that step (the learning-rate schedule still spans `cfg.steps`), e.g. to resume later.

    Works unchanged in one process or many: each process feeds its own rows of every global batch.
    """
    import jax

    from jaxnn import parallel
    from jaxnn.train import classification_loss, create_train_state, make_optimizer

    mesh = parallel.make_mesh() if mesh is None else mesh
    images, labels = load_digits()
    model = _model(cfg.model)
    tx = make_optimizer(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=min(10, cfg.steps // 10))
    key = jax.random.key(cfg.seed)
    dp = parallel.data_parallel_train_step(model, classification_loss, tx, mesh=mesh, form=cfg.form)
    create = lambda: create_train_state(model, tx, key, (cfg.global_batch, *images.shape[1:]))  # noqa: E731
    state = dp.place_state(create())
    if restore_dir:
        if cfg.form == "pmap":
            raise ValueError("multihost.train: restoring is for forms 'jit' and 'shard_map', not 'pmap'")
        state = restore_state(restore_dir, state)
    rows = parallel.process_slice(cfg.global_batch, mesh)
    loss = float("nan")
    last = cfg.steps if until is None else until
    for step in range(int(local_value(dp.unreplicate(state).step)), last):
        idx = batch_indices(cfg, step, len(labels))[rows]
        state, metrics = dp.step(state, dp.place_batch({"x": images[idx], "y": labels[idx]}))
        if on_step is not None:
            on_step(step)
        if (step + 1) % log_every == 0 or step + 1 == last or step == 0:
            loss = float(local_value(metrics["loss"]))
            log.info("process %d step %d loss %.4f", jax.process_index(), step + 1, loss)
    state = dp.unreplicate(state)
    if checkpoint_dir:
        save_state(checkpoint_dir, state)
    return state, loss


class Watchdog:
    """Ends this process with a clear error if no step finishes for `timeout_s` (a peer died mid-collective).

    jax's coordination service normally ends the survivors first (after its heartbeat timeout); this is the
    bound for anything it misses.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s, self.last = timeout_s, time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def ping(self, *_):
        self.last = time.monotonic()

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            if time.monotonic() - self.last > self.timeout_s:
                sys.stderr.write(f"jaxnn.multihost: no training step finished in {self.timeout_s:.0f} s; another "
                                 "process has probably died; stopping\n")
                sys.stderr.flush()
                os._exit(3)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class WorkerResult:
    process_id: int
    returncode: int | None   # None: killed by the launcher
    stdout: str
    stderr: str
    result: dict | None      # the worker's final JSON report


def launch_local(num_processes: int, worker_args: list[str], *, devices_per_process: int = 1,
                 timeout_s: float = 600, grace_s: float = 30) -> list[WorkerResult]:
    """Starts `num_processes` workers on 127.0.0.1 and waits for them; never hangs.

    When a worker fails, the others get `grace_s` to stop on their own (jax's heartbeat ends them) before
    they are killed; every worker is killed after `timeout_s`.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the device count comes from --devices-per-process
    with tempfile.TemporaryDirectory(prefix="jaxnn-multihost-") as logs:
        procs, files = [], []
        for i in range(num_processes):
            out, err = open(f"{logs}/{i}.out", "w+"), open(f"{logs}/{i}.err", "w+")
            files.append((out, err))
            cmd = [sys.executable, "-m", "jaxnn.multihost", "--worker", "--coordinator", coordinator,
                   "--num-processes", str(num_processes), "--process-id", str(i),
                   "--devices-per-process", str(devices_per_process), *worker_args]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
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
                        p.returncode = None
                break
            time.sleep(0.2)
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close(), err.close()
            report = [json.loads(line[len(RESULT_TAG):]) for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
            results.append(WorkerResult(i, p.returncode, stdout, stderr, report[-1] if report else None))
    return results


def failure_reason(stderr: str) -> str:
    """The line of a failed worker's stderr that says why (jax's fatal-error line, the watchdog, a traceback's end)."""
    lines = [line.strip() for line in stderr.splitlines()
             if line.strip() and not line.lstrip().startswith(("@", "***", "[Gloo]"))]
    for marker in ("Terminating process because", "jaxnn.multihost:", "Error"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else "(no output)"


def _worker(args) -> None:
    from jaxnn import parallel

    parallel.configure_cpu_devices(args.devices_per_process)
    parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    heartbeat_timeout_s=args.heartbeat_timeout)
    import jax

    cfg = RunConfig(model=args.model, steps=args.steps, global_batch=args.global_batch,
                    learning_rate=args.learning_rate, seed=args.seed, form=args.form)
    watchdog = Watchdog(args.step_timeout)

    def on_step(step):
        watchdog.ping()
        if args.fail_at is not None and tuple(args.fail_at) == (jax.process_index(), step):
            sys.stderr.write(f"jaxnn.multihost: process {jax.process_index()} failing at step {step} (--fail-at)\n")
            os._exit(17)

    state, loss = train(cfg, checkpoint_dir=args.checkpoint_dir, restore_dir=args.restore_dir, on_step=on_step)
    watchdog.ping()
    report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
              "step": int(local_value(state.step)), "loss": loss, "params_digest": params_digest(state.params)}
    print(RESULT_TAG + json.dumps(report), flush=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxnn.multihost", description=__doc__.splitlines()[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices in each process")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--form", default="jit", choices=("jit", "shard_map"))
    p.add_argument("--checkpoint-dir", help="write the final state here (orbax, by all processes)")
    p.add_argument("--restore-dir", help="resume from the latest checkpoint here")
    p.add_argument("--heartbeat-timeout", type=int, default=10,
                   help="seconds after which a silent process counts as dead and the others stop")
    p.add_argument("--step-timeout", type=float, default=300, help="watchdog: longest a step may take")
    p.add_argument("--timeout", type=float, default=900, help="launcher: kill every worker after this")
    p.add_argument("--worker", action="store_true", help="run one worker (the launcher passes this)")
    p.add_argument("--coordinator", help="host:port of process 0 (worker only)")
    p.add_argument("--process-id", type=int, help="worker only")
    p.add_argument("--fail-at", type=int, nargs=2, metavar=("PROCESS", "STEP"),
                   help="fault injection: that process exits at that step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.worker:
        _worker(args)
        return 0
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("model", "steps", "global_batch", "learning_rate", "seed", "form", "checkpoint_dir",
                            "restore_dir", "heartbeat_timeout", "step_timeout") and v is not None]
    if args.fail_at:
        passthrough += ["--fail-at", *map(str, args.fail_at)]
    t0 = time.monotonic()
    results = launch_local(args.num_processes, passthrough, devices_per_process=args.devices_per_process,
                           timeout_s=args.timeout, grace_s=args.heartbeat_timeout + 20)
    print(f"{args.num_processes} processes x {args.devices_per_process} CPU device(s) on 127.0.0.1, "
          f"{args.steps} steps of {args.model} on digits, global batch {args.global_batch}, "
          f"{time.monotonic() - t0:.1f} s")
    for r in results:
        if r.result:
            print(f"  process {r.process_id} of {r.result['processes']} ({r.result['devices']} devices in the mesh): "
                  f"step {r.result['step']} final loss {r.result['loss']:.4f} params {r.result['params_digest']}")
        else:
            print(f"  process {r.process_id}: failed (exit {r.returncode}): {failure_reason(r.stderr)}")
    if all(r.returncode == 0 and r.result for r in results):
        same = len({r.result["params_digest"] for r in results}) == 1
        print("params identical on every process" if same else "PARAMS DIFFER between processes")
        return 0 if same else 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
