"""The documented commands with wrong arguments: each prints one `jaxnn: error:` line naming the culprit, exits 2
and writes nothing; a damaged newest checkpoint is reported by jaxnn alone, without orbax's or asyncio's echoes."""

import pathlib
import shutil
import subprocess
import sys

import numpy as np
import optax
import pytest

from jaxnn import cli, fit
from jaxnn import layers as L

TRAIN = ["train", "--model", "mlp", "--size", "small", "--steps", "2", "--batch-size", "8", "--no-progress"]
TRAIN += ["--no-plots", "--no-summary"]
QUIET = {"progress": False, "plots": False}


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    """A folder with a finished two-checkpoint run (`run`), an empty folder and a plain file."""
    root = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(0)
    data = rng.normal(size=(32, 8)).astype(np.float32), rng.integers(0, 3, 32)
    model = L.serial(L.Dense(8), L.Relu, L.Dense(3))
    fit(
        model,
        data,
        optimizer=optax.adam(1e-3),
        run_dir=str(root / "run"),
        steps=4,
        batch_size=16,
        ckpt_every=2,
        **QUIET,
    )
    (root / "empty").mkdir()
    (root / "afile").write_text("not a directory")
    return root


def snapshot(directory) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in pathlib.Path(directory).rglob("*") if p.is_file()}


# (argv with {root} for the folder above, what the one line must say)
CASES = [
    (["export", "--run-dir", "{root}/nope", "--out", "{root}/o"], "{root}/nope: no such run or checkpoint directory"),
    (["export", "--run-dir", "{root}/afile", "--out", "{root}/o"], "{root}/afile is a file, not a run or checkpoint"),
    (["export", "--run-dir", "{root}/empty", "--out", "{root}/o"], "{root}/empty: holds no checkpoint"),
    (
        ["export", "--run-dir", "{root}/run", "--out", "{root}/o", "--step", "99"],
        "no checkpoint at step 99; it has steps 2, 4",
    ),
    (["export", "--run-dir", "{root}/run", "--out", "{root}/afile", "--safetensors-only"], "{root}/afile is a file"),
    (["export", "--run-dir", "{root}/run", "--out", "{root}/o", "--platforms", "gpu"], "invalid choice: 'gpu'"),
    (["export", "--run-dir", "{root}/run"], "jaxnn export: the following arguments are required: --out"),
    (["generate", "--run-dir", "{root}/nope"], "{root}/nope: no such run or checkpoint directory"),
    (["generate", "--run-dir", "{root}/run", "--step", "7"], "no checkpoint at step 7"),
    (["generate", "--run-dir", "{root}/run", "--length", "0"], "--length must be positive, got 0"),
    (["generate", "--run-dir", "{root}/run", "--step", "x"], "argument --step: invalid int value: 'x'"),
    ([*TRAIN, "--run-dir", "{root}/r", "--mesh", "data=x"], "mesh 'data=x': the size of 'data' must be a positive"),
    ([*TRAIN, "--run-dir", "{root}/r", "--model-config", "nosuch=3"], "model 'mlp' has no config field(s) ['nosuch']"),
    ([*TRAIN, "--run-dir", "{root}/r", "--precision", "fp4"], "unknown precision 'fp4'"),
    (
        [*TRAIN, "--run-dir", "{root}/r", "--mesh", "tensor=2", "--sharding-rules", "{root}/nope.json"],
        "sharding rules '{root}/nope.json': cannot read a JSON table",
    ),
    ([*TRAIN, "--run-dir", "{root}/afile"], "{root}/afile is a file, not a directory"),
    (
        [*TRAIN, "--run-dir", "{root}/r", "--ckpt-dir", "{root}/run/ckpt"],
        "checkpoint dir {root}/run/ckpt belongs to run",
    ),
    ([*TRAIN, "--model", "nosuch"], "unknown model 'nosuch'"),
    (["profile", "--model", "mlp", "--model-config", "nosuch=1"], "model 'mlp' has no config field(s) ['nosuch']"),
    (["profile", "--model", "mlp", "--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["profile", "--model", "mlp", "--out", "{root}/afile"], "{root}/afile is a file, not a directory"),
    (["nosuch"], "argument command: invalid choice: 'nosuch'"),
]


def test_wrong_arguments_give_one_error_line_naming_the_culprit_and_write_nothing(area, capsys):
    before = snapshot(area)
    wrong = []
    for argv, culprit in CASES:
        argv, culprit = [a.format(root=area) for a in argv], culprit.format(root=area)
        try:
            status = cli.main(argv)
        except BaseException as err:  # noqa: BLE001 - a traceback or argparse's own exit is what is looked for
            status = f"raised {type(err).__name__}: {err}"
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        if status != 2 or len(lines) != 1 or not lines[0].startswith("jaxnn: error: ") or culprit not in lines[0]:
            wrong.append(f"{' '.join(argv)}\n  -> status {status}, stderr {out.err!r}")
    assert not wrong, "\n".join(wrong)
    assert snapshot(area) == before


def test_a_damaged_newest_checkpoint_falls_back_without_library_noise(area, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(area / "run" / "ckpt", run / "ckpt")
    newest = run / "ckpt" / "4"
    for chunk in newest.glob("state/**/d/*"):  # the arrays' bytes cut in half: a half-written save
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    script = (
        "import logging\nfrom jaxnn import cli\nfrom jaxnn.checkpoint import load_params\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')\n"
        f"for _ in range(4): assert load_params({str(run)!r}).step == 2\n"
        f"assert cli.main(['export', '--run-dir', {str(run)!r}, '--out', {str(tmp_path / 'out')!r}, "
        "'--safetensors-only']) == 0\n"
        "import gc, time; gc.collect(); time.sleep(0.3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    noise = [line for line in done.stderr.splitlines() if not line.startswith("WARNING jaxnn.checkpoint: checkpoint")]
    assert noise == [], "\n".join(noise[:20])
    assert "checkpoint " + str(newest) in done.stderr  # the damage itself is reported, once per read
