"""Multi-process runs: `jaxnn train` workers on 127.0.0.1 (gloo) form one run through the same loop as any run;
checkpoints move between process counts; a dying peer stops the others with a clear error."""

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import sharded_mlp

from jaxnn.callbacks import Callback
from jaxnn.checkpoint import Checkpointer
from jaxnn.cli import multihost
from jaxnn.cli.config import TrainConfig
from jaxnn.cli.recipes import train
from jaxnn.config import FitConfig
from jaxnn.models import MLP, MLPConfig
from jaxnn.parallel import create_sharded_state, make_mesh
from jaxnn.train import create_train_state, make_optimizer

ARGS = [
    "--model",
    "mlp",
    "--size",
    "small",
    "--steps",
    "12",
    "--batch-size",
    "16",
    "--lr",
    "0.01",
    "--ckpt-every",
    "6",
    "--no-progress",
    "--no-plots",
    "--no-summary",
    "--backend",
    "inline",
]
CFG = TrainConfig(
    model="mlp",
    size="small",
    lr=0.01,
    backend="inline",
    fit=FitConfig(steps=12, batch_size=16, ckpt_every=6, progress=False, plots=False),
)


class StopAt(Callback):
    """Asks the loop to stop (with a checkpoint) after `step`, as a signal would."""

    def __init__(self, step):
        self.step = step

    def on_step(self, run, step, metrics):
        # Metrics arrive one step late: step - 1's are read once `step` is dispatched.
        if step + 1 >= self.step:
            run.request_stop("test")


def restore_params(run_dir):
    model = MLP(MLPConfig(num_classes=10).small())
    tx = make_optimizer(0.01, total_steps=12)
    like = create_train_state(model, tx, jax.random.key(0), (16, 8, 8, 1))
    state, _, step = Checkpointer(run_dir / "ckpt").restore(like, json.loads((run_dir / "config.json").read_text()))
    return state, step


def test_two_processes_resume_a_one_process_checkpoint_with_fsdp_and_match_one_process(tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    # One process trains to step 6 and stops there with a checkpoint ...
    half = train(dataclasses.replace(CFG, fit=dataclasses.replace(CFG.fit, run_dir=str(two))), callbacks=[StopAt(6)])
    assert half["step"] == 6 and half["stopped_by"] == "test"
    # ... two processes (the `make train-multihost` launcher) resume it, with parameters and Adam moments sharded
    # over both (FSDP across processes: each holds half), and train on to step 12 ...
    code = multihost.main(
        ["--run-dir", str(two), "--heartbeat-timeout", "10", "--timeout", "240", "--", *ARGS, "--resume"]
        + ["--mesh", "fsdp=2"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 processes x 1 CPU device(s) on 127.0.0.1" in out and "params identical on every process" in out
    assert "process 1 of 2 (2 devices in the mesh): step 12" in out
    resumed = json.loads((two / "summary.json").read_text())
    assert resumed["resumed_from"] == 6 and resumed["step"] == 12
    # ... and equal (to all-reduce rounding) an uninterrupted one-process run on the same batches.
    single = train(dataclasses.replace(CFG, fit=dataclasses.replace(CFG.fit, run_dir=str(one))))
    assert abs(resumed["eval_loss"] - single["eval_loss"]) < 1e-4
    (a, step_a), (b, step_b) = restore_params(two), restore_params(one)
    assert step_a == step_b == 12
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6), a.params, b.params
    )
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6),
        a.opt_state,
        b.opt_state,
    )


def test_survivor_stops_with_clear_error_when_a_peer_dies(tmp_path):
    t0 = time.monotonic()
    results = multihost.launch_local(
        2,
        [
            *ARGS[:5],
            "200",
            *ARGS[6:],
            "--run-dir",
            str(tmp_path / "r"),
            "--heartbeat-timeout",
            "5",
            "--fail-at",
            "1",
            "3",
        ],
        timeout_s=150,
        grace_s=60,
    )
    elapsed = time.monotonic() - t0
    dead, survivor = results[1], results[0]
    assert dead.returncode == 17 and "exiting at step 3" in dead.stderr, dead.stderr[-2000:]
    # The survivor ended itself (it was not killed by the launcher: returncode None) with a clear error.
    assert survivor.returncode not in (0, None), survivor.stderr[-2000:]
    assert "detected fatal errors" in survivor.stderr or "another process has probably died" in survivor.stderr, (
        survivor.stderr[-2000:]
    )
    assert survivor.result is None
    assert elapsed < 120


def test_configure_cpu_devices_in_fresh_process():
    code = (
        "from jaxnn.parallel.mesh import configure_cpu_devices; configure_cpu_devices(4); import jax; "
        "print(jax.device_count()); configure_cpu_devices(4)\n"
        "try:\n configure_cpu_devices(2)\nexcept RuntimeError as e: print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "4"
    assert "configure_cpu_devices(2) called after jax started with 4 devices" in lines[1]


def slurm_port() -> int:
    """A free port in the range jax's SLURM detection derives from the job id (61440 + job id % 4096)."""
    for port in range(61440 + 1000, 65536):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in jax's SLURM range")


def test_a_slurm_job_is_detected_and_fsdp_spans_its_processes(tmp_path):
    """What `srun jaxnn train --cluster ...` gives each task: SLURM's variables, from which jax's cluster detection
    takes the coordinator (the first node of the step), the process count and each process's id."""
    job_id = slurm_port() - 61440
    run_dir = tmp_path / "slurm"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for task in range(2):
        slurm = {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
            "SLURM_STEP_NUM_NODES": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "jaxnn.cli",
            "train",
            *ARGS,
            "--run-dir",
            str(run_dir),
            "--cluster",
            "--mesh",
            "fsdp=2",
            "--heartbeat-timeout",
            "10",
        ]
        procs.append(
            subprocess.Popen(cmd, env={**env, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    reports = [multihost.RESULT_LINE.search(out) for out, _ in outputs]
    assert [r and (r["process"], r["processes"], r["devices"]) for r in reports] == [("0", "2", "2"), ("1", "2", "2")]
    assert "jaxnn.parallel.report: layout (jaxnn built-in rules)" in outputs[0][1]  # printed before training
    assert reports[0]["params"] == reports[1]["params"]  # one model, gathered from the shards of both
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 12


def test_two_processes_of_four_devices_match_one_device_and_their_checkpoints_restore_elsewhere(tmp_path):
    """Two processes of 4 simulated devices each, started as a Kubernetes indexed Job starts its pods (one
    environment, the process id from JOB_COMPLETION_INDEX), train the MLP under fsdp=8 and under data=2,tensor=4
    with user rules; each run's final checkpoint, restored in this one process on another mesh, holds the
    one-device parameters."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAXNN_COORDINATOR": f"127.0.0.1:{port}", "JAXNN_NUM_PROCESSES": "2"}
    worker = [sys.executable, str(pathlib.Path(__file__).parents[1] / "sharded_mlp.py"), str(tmp_path)]
    procs = [
        subprocess.Popen(worker, env={**env, "JOB_COMPLETION_INDEX": str(i)}, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-2000:]
    one = sharded_mlp.fit_mlp(make_mesh(1)).state.params
    create = lambda: create_train_state(sharded_mlp.mlp(), sharded_mlp.optimizer(), jax.random.key(0), (16, 16))  # noqa: E731
    for run, mesh in (("fsdp", make_mesh("tensor=2,fsdp=4")), ("dxt", make_mesh(1))):
        like = create_sharded_state(create, mesh, sharded_mlp.RULES)
        config = json.loads((tmp_path / run / "config.json").read_text())
        restored, _, step = Checkpointer(tmp_path / run / "ckpt").restore(like, config)
        assert step == sharded_mlp.STEPS, run
        for a, b, like_leaf in zip(
            jax.tree.leaves(restored.params), jax.tree.leaves(one), jax.tree.leaves(like.params)
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=run)
            assert a.sharding == like_leaf.sharding
