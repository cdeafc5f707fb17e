"""Who owns what: a run never writes into, rotates or removes another run's checkpoints; overwrite removes only the
run's own files; an export folder holds one export; a run directory in use names its holder to every caller.
Each refusal is one line naming the directory, raised before anything is written: every file that was there is
byte-identical after."""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import optax
import pytest

from jaxnn import cli, fit
from jaxnn import layers as L
from jaxnn._src.ownership import OWNER_FILE
from jaxnn._src.storage import RunDirError
from jaxnn.checkpoint import load_params, load_train_state
from jaxnn.export import export_run, write_export

SETTINGS = {"steps": 4, "batch_size": 16, "ckpt_every": 2, "keep": 3, "progress": False, "plots": False}


def model():
    return L.serial(L.Dense(8), L.Relu, L.Dense(3))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64)


def train(data, run_dir, **settings):
    # A schedule that does not depend on `steps`, so that a resume may train on.
    return fit(model(), data, optimizer=optax.adam(1e-3), run_dir=str(run_dir), **{**SETTINGS, **settings})


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    """A finished run (checkpoints at steps 2 and 4), copied by each test that changes it."""
    run = tmp_path_factory.mktemp("base") / "run"
    return run, train(data, run).state


def copy_of(base, tmp_path, name="run") -> pathlib.Path:
    shutil.copytree(base[0], tmp_path / name)
    return tmp_path / name


def snapshot(directory) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in pathlib.Path(directory).rglob("*") if p.is_file()}


def owner(directory) -> str:
    return json.loads((pathlib.Path(directory) / OWNER_FILE).read_text())["run_id"]


@pytest.mark.parametrize("mode", [{}, {"overwrite": True}, {"resume": True}])
def test_another_runs_checkpoint_dir_is_refused_naming_its_owner(base, data, tmp_path, mode):
    theirs = copy_of(base, tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(
        RunDirError, match=rf"^checkpoint dir {theirs / 'ckpt'} belongs to run {owner(theirs)} \(run dir {base[0]}\)"
    ):
        train(data, tmp_path / "mine", ckpt_dir=str(theirs / "ckpt"), keep=1, **mode)
    assert snapshot(tmp_path) == before and not (tmp_path / "mine").exists()


def test_a_checkpoint_dir_holding_foreign_files_is_refused(data, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match=rf"^checkpoint dir {ckpt} holds files jaxnn did not write \(notes.txt\)"):
        train(data, tmp_path / "run", ckpt_dir=str(ckpt))
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_overwrite_removes_only_the_runs_own_files_and_says_so(base, data, tmp_path, caplog):
    run = copy_of(base, tmp_path)
    (run / "notes.txt").write_text("mine")
    (run / "ckpt" / "README").write_text("kept beside the checkpoints")
    old = owner(run)
    foreign = {name: (run / name).read_bytes() for name in ("notes.txt", "ckpt/README")}
    train(data, run, overwrite=True, steps=2)
    assert {name: (run / name).read_bytes() for name in foreign} == foreign
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["2", "README", OWNER_FILE]
    assert owner(run) == owner(run / "ckpt") != old
    assert f"overwrite: removed the previous run's files from {run}: " in caplog.text
    assert "ckpt/4" in caplog.text and "notes.txt" not in caplog.text


def test_an_old_run_dir_without_owner_files_keeps_resuming_and_is_adopted(base, data, tmp_path):
    run = copy_of(base, tmp_path)
    for path in (run / OWNER_FILE, run / "ckpt" / OWNER_FILE):
        path.unlink()  # as written before owner files existed
    result = train(data, run, resume=True, steps=6)
    assert result.summary["resumed_from"] == 4 and result.summary["step"] == 6
    assert owner(run) == owner(run / "ckpt")
    with pytest.raises(RunDirError, match=r"^checkpoint dir .* belongs to run"):
        train(data, tmp_path / "other", ckpt_dir=str(run / "ckpt"), resume=True)


def test_reading_another_runs_checkpoints_leaves_its_save_in_progress(base, tmp_path):
    run = copy_of(base, tmp_path)
    in_progress = run / "ckpt" / "6.orbax-checkpoint-tmp-1700000000"
    (in_progress / "state").mkdir(parents=True)
    (in_progress / "state" / "part").write_bytes(b"being written")
    before = snapshot(tmp_path)
    _, step = load_train_state(run, base[1])
    assert step == 4 and snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def full_export(base, tmp_path_factory):
    """A full export of the base run's step 4, as `jaxnn export` writes it for a built-in model."""
    loaded = load_params(base[0], step=4)
    out = tmp_path_factory.mktemp("export") / "out"
    config = {**loaded.config, "step": 4}
    return write_export(out, model(), loaded.params, loaded.model_state, (8,), dtype="float32", config=config)


def test_an_export_folder_holding_another_export_is_refused(base, full_export, tmp_path):
    before = snapshot(full_export)
    with pytest.raises(
        RunDirError,
        match=rf"^export folder {full_export} holds the export of another checkpoint or config \(export.json differs",
    ):
        export_run(base[0], full_export, step=2, safetensors_only=True)
    assert snapshot(full_export) == before
    export_run(base[0], full_export, step=4, safetensors_only=True)  # the same export again: its own files
    assert snapshot(full_export) == before


def test_a_killed_exports_temporary_file_is_removed_by_the_rerun(base, tmp_path):
    out = tmp_path / "out"
    export_run(base[0], out, step=4, safetensors_only=True)
    ended = subprocess.Popen(["true"])
    ended.wait()
    leftover = out / f".weights.safetensors.tmp-{ended.pid}"  # left by a process that is gone
    leftover.write_bytes(b"half a file")
    export_run(base[0], out, step=4, safetensors_only=True)
    assert not leftover.exists()


def test_an_export_folder_holding_foreign_files_is_refused(base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"another tool's")
    before = snapshot(tmp_path)
    assert cli.main(["export", "--run-dir", str(base[0]), "--out", str(out), "--safetensors-only"]) == 2
    assert snapshot(tmp_path) == before


@pytest.mark.system
def test_a_run_dir_in_use_names_its_holder_to_fit_and_the_cli(base, data, tmp_path, capsys, caplog):
    run = copy_of(base, tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom jaxnn.loop.rundir import RunLock\n"
            f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        in_use = rf"^run dir {run} is in use by process {holder.pid} on host "
        # A used directory, a resume, another config: the holder is named before anything else is judged.
        for settings in ({}, {"resume": True}, {"steps": 6, "resume": True}, {"overwrite": True}):
            with pytest.raises(RunDirError, match=in_use):
                train(data, run, **settings)
        capsys.readouterr()
        assert cli.main(["train", "--model", "mlp", "--size", "small", "--no-summary", "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"jaxnn: error: run dir {run} is in use by process {holder.pid}") and "\n" not in err
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    result = train(data, run, resume=True, steps=6)  # the holder died without releasing: taken over
    assert f"taking over the lock left by process {holder.pid}" in caplog.text and result.summary["step"] == 6
