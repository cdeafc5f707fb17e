"""The smoke tier: every make target, runnable module and documented command of tests/smoke_commands.py, run once at
its smallest size in a copy of the checkout (so nothing in the checkout's results/ is overwritten). A run passes
when it exits 0; what each one computes is checked by the tests of its own area."""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest
from smoke_commands import ROOT, smoke_lines

# What a copy leaves out: the venv (used in place), git's store, and what runs and builds write.
_NOT_COPIED = shutil.ignore_patterns(
    ".venv", ".git", "build", "runs", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "*.egg-info"
)


def checkout_copy(dest: pathlib.Path) -> pathlib.Path:
    """The working tree (uncommitted changes and built kernels included) copied with its files' times, so that
    make finds the venv's stamps and the built kernels up to date."""
    shutil.copytree(ROOT, dest, ignore=_NOT_COPIED, symlinks=True)
    return dest


def command(part: str) -> list[str]:
    """The argv of one documented step: `make` against this interpreter's venv, never installing into it;
    `jaxnn` and `python` as this interpreter; anything else (echo) through the shell."""
    argv = shlex.split(part)
    venv = pathlib.Path(sys.prefix)
    if argv[0] == "make":
        stamps = [f"-o{venv / '.installed'}", f"-o{venv / '.installed-bench'}"]
        return ["make", "-s", f"VENV={venv}", *stamps, *argv[1:]]
    if argv[0] == "jaxnn":
        return [sys.executable, "-m", "jaxnn.cli", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return ["bash", "-c", part]


@pytest.mark.slow
@pytest.mark.parametrize("line", smoke_lines())
def test_runs(line, tmp_path):
    cwd = checkout_copy(tmp_path / "jaxnn")
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(cwd)
    for part in line.split(" && "):
        proc = subprocess.run(command(part), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{part}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
