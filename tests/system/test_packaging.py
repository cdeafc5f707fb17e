"""The wheel, as a user gets it: built from the checkout, installed into a fresh virtual environment outside it,
and run there (`jaxnn train`, the layers, the version, the type information, a missing extra's hint)."""

import os
import pathlib
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import jaxnn

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = wheels.glob("jaxnn-*.whl")
    assert wheel.name.startswith(f"jaxnn-{jaxnn.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "jaxnn/py.typed" in names and "jaxnn/layers/attention.py" in names
    assert not any(n.startswith(("tests/", "experiments/", "benchmarks/")) for n in names)
    assert any(n.endswith("licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # Without PYTHONPATH: a checkout on it (with the jaxnn.egg-info the wheel build leaves) reads as jaxnn installed.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300, env=clean)
    # The dependencies (not jaxnn) come from this environment's site-packages: a path line in a .pth file, which
    # adds the directory without running the .pth files in it (so this checkout's editable install stays out).
    venv_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if pathlib.Path(p).is_dir()]
    pathlib.Path(venv_site, "deps.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    work = tmp_path / "work"
    work.mkdir()

    check = "import jaxnn, jaxnn.layers as L; print(jaxnn.__file__, jaxnn.__version__, L.Dense(3).name)"
    out = subprocess.run([python, "-c", check], cwd=work, env=env, check=True, capture_output=True, text=True).stdout
    assert out.startswith(str(venv)) and out.split()[1:] == [jaxnn.__version__, "dense"], out
    train = [
        str(venv / "bin" / "jaxnn"),
        "train",
        "--model",
        "mlp",
        "--size",
        "small",
        "--steps",
        "5",
        "--batch-size",
        "16",
        "--no-progress",
        "--no-plots",
        "--no-summary",
        "--run-dir",
        str(work / "run"),
    ]
    done = subprocess.run(train, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 5/5" in done.stdout and (work / "run" / "summary.json").is_file()


def test_a_missing_extra_is_named_in_one_line(monkeypatch):
    from jaxnn._src import optional

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(
        ImportError, match=r"^metric writer 'tensorboard' needs tensorboardX: pip install 'jaxnn\[tensorboard\]'$"
    ):
        optional.require("tensorboardX", "metric writer 'tensorboard'")
    assert optional.hint("sklearn.datasets") == "pip install 'jaxnn[data]'"
