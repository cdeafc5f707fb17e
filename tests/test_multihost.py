"""Two local processes on 127.0.0.1 training together (gloo), checkpoints across process counts, a dying peer."""

import subprocess
import sys
import time

import jax
import numpy as np

from jaxnn import multihost, parallel

CFG = multihost.RunConfig(model="mlp", steps=6, global_batch=16, learning_rate=1e-2)
HALF = 3


def test_two_processes_resume_one_process_checkpoint_and_match_one_process_run(tmp_path):
    mesh = parallel.make_mesh()
    # One process writes the state of the run at step HALF ...
    half, _ = multihost.train(CFG, mesh=mesh, until=HALF)
    assert int(half.step) == HALF
    multihost.save_state(str(tmp_path / "one"), half)

    # ... two processes restore it, train on to CFG.steps with their own halves of each batch, and save.
    args = [f"--steps={CFG.steps}", f"--global-batch={CFG.global_batch}", f"--learning-rate={CFG.learning_rate}",
            f"--restore-dir={tmp_path / 'one'}", f"--checkpoint-dir={tmp_path / 'two'}", "--heartbeat-timeout=10"]
    results = multihost.launch_local(2, args, timeout_s=240)
    for r in results:
        assert r.returncode == 0, f"process {r.process_id} failed:\n{r.stderr[-3000:]}"
    reports = [r.result for r in results]
    assert [(r["process"], r["processes"], r["devices"], r["step"]) for r in reports] == [(0, 2, 2, 6), (1, 2, 2, 6)]
    assert reports[0]["params_digest"] == reports[1]["params_digest"]  # bitwise identical on both processes
    assert reports[0]["loss"] == reports[1]["loss"]

    # One process restores what the two wrote; it equals an uninterrupted one-process run on the same batches.
    reference, ref_loss = multihost.train(CFG, mesh=mesh)
    restored = multihost.restore_state(str(tmp_path / "two"), reference)
    assert int(restored.step) == CFG.steps
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6),
                 restored.params, reference.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6),
                 restored.opt_state, reference.opt_state)
    np.testing.assert_allclose(reports[0]["loss"], ref_loss, rtol=1e-5)
    assert not np.allclose(np.asarray(restored.params["1_dense"]["w"]), np.asarray(half.params["1_dense"]["w"]))


def test_survivor_stops_with_clear_error_when_a_peer_dies():
    t0 = time.monotonic()
    results = multihost.launch_local(2, ["--steps=200", "--global-batch=16", "--heartbeat-timeout=5",
                                         "--fail-at", "1", "2"], timeout_s=150, grace_s=60)
    elapsed = time.monotonic() - t0
    dead, survivor = results[1], results[0]
    assert dead.returncode == 17 and "failing at step 2" in dead.stderr
    # The survivor ended itself (it was not killed by the launcher: returncode None) with a clear error.
    assert survivor.returncode not in (0, None), survivor.stderr[-2000:]
    assert ("detected fatal errors" in survivor.stderr or "another process has probably died" in survivor.stderr), \
        survivor.stderr[-2000:]
    assert survivor.result is None
    assert elapsed < 120


def test_launcher_cli_reports_agreement():
    out = subprocess.run([sys.executable, "-m", "jaxnn.multihost", "--num-processes", "2", "--steps", "4",
                          "--global-batch", "16", "--timeout", "200"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "params identical on every process" in out.stdout
    assert out.stdout.count("final loss") == 2


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
