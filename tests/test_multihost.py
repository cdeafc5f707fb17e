"""Two local processes on 127.0.0.1 training together (gloo), checkpoints across process counts, a dying peer."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from jaxnn import multihost, parallel

CFG = multihost.RunConfig(model="mlp", steps=6, global_batch=16, learning_rate=1e-2)
HALF = 3


def test_two_processes_resume_one_process_checkpoint_and_match_one_process_run(tmp_path, capsys):
    mesh = parallel.make_mesh()
    # One process writes the state of the run at step HALF ...
    half, _ = multihost.train(CFG, mesh=mesh, until=HALF)
    assert int(half.step) == HALF
    multihost.save_state(str(tmp_path / "one"), half)

    # ... two processes (the `make train-multihost` launcher) restore it, train on to CFG.steps with their own
    # halves of each batch, and save.
    code = multihost.main([f"--steps={CFG.steps}", f"--global-batch={CFG.global_batch}",
                           f"--learning-rate={CFG.learning_rate}", f"--restore-dir={tmp_path / 'one'}",
                           f"--checkpoint-dir={tmp_path / 'two'}", "--heartbeat-timeout=10", "--timeout=240"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 processes x 1 CPU device(s) on 127.0.0.1" in out
    reports = re.findall(r"process (\d) of 2 \(2 devices in the mesh\): step (\d+) final loss (\S+) params (\w+)", out)
    assert [(p, step) for p, step, _, _ in reports] == [("0", "6"), ("1", "6")], out
    assert reports[0][2:] == reports[1][2:]  # same loss, bitwise identical parameters on both processes
    assert "params identical on every process" in out

    # One process restores what the two wrote; it equals an uninterrupted one-process run on the same batches.
    reference, ref_loss = multihost.train(CFG, mesh=mesh)
    restored = multihost.restore_state(str(tmp_path / "two"), reference)
    assert int(restored.step) == CFG.steps
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6),
                 restored.params, reference.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6),
                 restored.opt_state, reference.opt_state)
    np.testing.assert_allclose(float(reports[0][2]), ref_loss, atol=1e-4)
    assert not np.allclose(np.asarray(restored.params["1_dense"]["w"]), np.asarray(half.params["1_dense"]["w"]))


def test_survivor_stops_with_clear_error_when_a_peer_dies():
    t0 = time.monotonic()
    # (shard_map form here, so that form also runs across processes; the resume test runs jit)
    results = multihost.launch_local(2, ["--steps=200", "--global-batch=16", "--heartbeat-timeout=5",
                                         "--form=shard_map", "--fail-at", "1", "2"], timeout_s=150, grace_s=60)
    elapsed = time.monotonic() - t0
    dead, survivor = results[1], results[0]
    assert dead.returncode == 17 and "failing at step 2" in dead.stderr
    # The survivor ended itself (it was not killed by the launcher: returncode None) with a clear error.
    assert survivor.returncode not in (0, None), survivor.stderr[-2000:]
    assert ("detected fatal errors" in survivor.stderr or "another process has probably died" in survivor.stderr), \
        survivor.stderr[-2000:]
    assert survivor.result is None
    assert "process 0 step 1 loss" in survivor.stderr  # it had trained with its peer before the peer died
    assert elapsed < 120


def test_configure_cpu_devices_in_fresh_process():
    code = ("from jaxnn.parallel import configure_cpu_devices; configure_cpu_devices(4); import jax; "
            "print(jax.device_count()); configure_cpu_devices(4)\n"
            "try:\n configure_cpu_devices(2)\nexcept RuntimeError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "4"
    assert "configure_cpu_devices(2) called after jax started with 4 devices" in lines[1]


def test_cli_trains_across_two_processes_like_one(tmp_path):
    """`jaxnn train --coordinator ... --num-processes 2 --process-id i` on loopback: one run, the same result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [sys.executable, "-m", "jaxnn.cli", "train", "--model", "mlp", "--size", "small", "--steps", "12",
              "--batch-size", "16", "--no-progress", "--no-plots", "--backend", "inline"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(common + ["--run-dir", str(tmp_path / "two"), "--coordinator", f"127.0.0.1:{port}",
                                        "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    one = subprocess.run(common + ["--run-dir", str(tmp_path / "one")], env=env, capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr
    two, single = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("two", "one"))
    assert two["step"] == single["step"] == 12
    assert abs(two["eval_loss"] - single["eval_loss"]) < 1e-4
    assert abs(two["eval_accuracy"] - single["eval_accuracy"]) < 1e-6
