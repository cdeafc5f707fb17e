"""A user's bad day, injected: a second run on the same directory, more signals during the final save, a full disk
while checkpointing or logging, files cut short by a crash. Each ends with what was in the run directory intact
and the run resumable to the parameters an undisturbed run reaches, bit for bit."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys

import custom_model
import numpy as np
import pytest

from jaxnn import cli, fit
from jaxnn import layers as L
from jaxnn._src import storage
from jaxnn.callbacks import Callback
from jaxnn.checkpoint import Checkpointer
from jaxnn.loop.rundir import RunDirError, RunLock, StorageError

pytestmark = pytest.mark.xdist_group("faults")  # one worker: the undisturbed reference run is computed once

CLI_RUN = ["train", "--model", "mlp", "--size", "small", "--steps", "40", "--batch-size", "16", "--ckpt-every", "10"]
CLI_RUN += ["--no-progress", "--no-plots", "--no-summary"]
SETTINGS = {
    "steps": 40,
    "batch_size": 32,
    "log_every": 5,
    "ckpt_every": 10,
    "keep": 5,
    "progress": False,
    "plots": False,
}


def model():
    return L.serial(L.Flatten(), L.Dense(32), L.Relu, L.Dense(10))


@pytest.fixture(scope="module")
def data():
    return custom_model.digits()


def train(run_dir, data, **settings):
    train_data, test = data
    return fit(model(), train_data, eval_data=test, run_dir=str(run_dir), **{**SETTINGS, **settings})


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("reference") / "run", data).summary["param_digest"]


def snapshot(directory) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in pathlib.Path(directory).rglob("*") if p.is_file()}


class StopAfter(Callback):
    def __init__(self, step):
        self.step = step

    def on_step(self, run, step, metrics):
        if step + 1 >= self.step:  # metrics arrive one step late
            run.request_stop("test")


def test_second_run_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path, data, caplog, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom jaxnn.loop.rundir import RunLock\n"
            f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=rf"run dir {run} is in use by process {holder.pid} on host "):
            train(run, data)
        assert cli.main(["train", "--model", "mlp", "--size", "small", "--no-summary", "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("jaxnn: error: run dir") and f"process {holder.pid}" in err and "\n" not in err
        assert [p.name for p in run.iterdir()] == ["run.lock"]  # nothing written by the refused runs
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock file names it; the next run takes over with a warning.
    assert json.loads((run / "run.lock").read_text())["pid"] == holder.pid
    train(run, data, steps=10)
    assert f"taking over the lock left by process {holder.pid}" in caplog.text
    assert not (run / "run.lock").exists()


def test_lock_on_the_same_directory_twice_in_one_process(tmp_path):
    with RunLock(tmp_path), pytest.raises(RunDirError, match="is in use by process"):
        RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released on exit: free again
        pass


def test_signals_during_the_final_save_do_not_interrupt_it(tmp_path, data, reference, monkeypatch, capfd):
    from jaxnn.loop._bookkeeping import Tracker

    run = tmp_path / "run"
    real_save, real_log = Checkpointer.save, Tracker.log

    def log(self, step, wait):
        if step == 14:
            os.kill(os.getpid(), signal.SIGTERM)  # the first signal: stop after this step, with a checkpoint
        return real_log(self, step, wait)

    def save(self, step, state, *, force=False, **kw):
        if force:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C and a SIGTERM while the final save runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(self, step, state, force=force, **kw)

    monkeypatch.setattr(Tracker, "log", log)
    monkeypatch.setattr(Checkpointer, "save", save)
    code = cli.main([*CLI_RUN, "--log-every", "7", "--run-dir", str(run)])
    assert code == 128 + signal.SIGTERM  # the exit status names the signal that stopped the run
    err = capfd.readouterr().err
    assert err.count("received while stopping; finishing the checkpoint first") == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted_by"] == signal.SIGTERM and summary["signals_ignored"] == 2
    steps = sorted(p.name for p in (run / "ckpt").iterdir() if p.name != "jaxnn-owner.json")
    assert steps == ["10", "14"]  # complete, no temporary folder
    monkeypatch.setattr(Checkpointer, "save", real_save)
    monkeypatch.setattr(Tracker, "log", real_log)
    assert cli.main([*CLI_RUN, "--run-dir", str(run), "--resume"]) == 0
    assert cli.main([*CLI_RUN, "--run-dir", str(tmp_path / "undisturbed")]) == 0
    resumed, undisturbed = (json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "undisturbed"))
    assert resumed["param_digest"] == undisturbed["param_digest"]  # bitwise, as if never stopped


def test_disk_full_while_checkpointing(tmp_path, data, reference, monkeypatch):
    import orbax.checkpoint as ocp

    run, before = tmp_path / "run", {}
    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 30:
            self.wait_until_finished()
            before.update(snapshot(run))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(StorageError) as info:
        train(run, data)
    message = str(info.value)
    assert (
        message.startswith(
            f"[Errno {errno.ENOSPC}] saving checkpoint step 30 to {run / 'ckpt'} failed: No space "
            "left on device (free space there: "
        )
        and "\n" not in message
    )
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k.parts[0] == "ckpt"} == {
        k: v for k, v in before.items() if k.parts[0] == "ckpt"
    }  # earlier checkpoints untouched
    assert after[pathlib.Path("metrics.jsonl")].startswith(before[pathlib.Path("metrics.jsonl")])
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)  # space freed
    result = train(run, data, resume=True)
    assert result.summary["resumed_from"] == 20 and result.summary["param_digest"] == reference


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path, data, monkeypatch):
    import shutil

    from jaxnn import checkpoint

    run = tmp_path / "run"
    real_usage = shutil.disk_usage
    saves = []

    def disk_usage(path):
        usage = real_usage(path)
        saves.append(path)
        return usage._replace(free=100_000) if len(saves) >= 2 else usage  # full from the second checkpoint on

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    with pytest.raises(
        StorageError,
        match=r"saving checkpoint step 20 to .* needs about [0-9.]+ MiB, 0.1 MiB free: "
        r"No space left on device; free some space, then resume",
    ):
        train(run, data)
    assert Checkpointer(run / "ckpt").all_steps() == [10] and not list((run / "ckpt").glob("*tmp*"))


def test_disk_full_while_logging(tmp_path, data, reference, monkeypatch):
    run = tmp_path / "run"
    real_write, calls = storage._write_all, []

    def write_all(fd, payload):
        calls.append(1)
        if len(calls) == 4:  # the fourth metrics line: half of it reaches the disk, then the disk is full
            os.write(fd, payload[: len(payload) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, payload)

    monkeypatch.setattr(storage, "_write_all", write_all)
    with pytest.raises(
        StorageError,
        match=rf"appending to {run / 'metrics.jsonl'} failed: No space left on device "
        r"\(free space there: ",
    ):
        train(run, data)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 3 and all(line.endswith("\n") and json.loads(line) for line in lines)  # no half line
    assert Checkpointer(run / "ckpt").all_steps() == [10]
    monkeypatch.setattr(storage, "_write_all", real_write)
    result = train(run, data, resume=True)
    assert result.summary["resumed_from"] == 10 and result.summary["param_digest"] == reference


def test_files_cut_short_by_a_crash_are_set_aside_and_the_run_resumes(tmp_path, data, reference, caplog):
    run = tmp_path / "run"
    assert train(run, data, callbacks=[StopAfter(20)]).summary["step"] == 20
    metrics, config = run / "metrics.jsonl", run / "config.json"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + b'{"split": "train", "step": 2')  # a crash in the middle of a line
    damaged_config = config.read_bytes()[:25]
    config.write_bytes(damaged_config)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match=r"holds a damaged config\.json .*pass --resume"):
        train(run, data)  # named for what it is, not "already holds a run"; nothing touched
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    result = train(run, data, resume=True)
    assert result.summary["resumed_from"] == 20 and result.summary["param_digest"] == reference
    assert metrics.read_bytes().startswith(whole)  # every complete line kept, byte for byte
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"][-1] == 40
    (partial,) = run.glob("metrics.jsonl.partial-*")
    assert partial.read_bytes() == b'{"split": "train", "step": 2'
    (aside,) = run.glob("config.json.damaged-*")
    assert aside.read_bytes() == damaged_config and json.loads(config.read_text())["steps"] == 40
    assert "cut short" in caplog.text and "was damaged" in caplog.text


def test_overwrite_removes_the_run_but_not_other_files(tmp_path, data):
    run = tmp_path / "run"
    train(run, data, steps=10, metrics=("csv",))
    (run / "notes.txt").write_text("mine")
    train(run, data, steps=10, overwrite=True)
    assert (run / "notes.txt").read_text() == "mine" and not (run / "metrics-train.csv").exists()
    assert np.isfinite(json.loads((run / "summary.json").read_text())["eval_loss"])
