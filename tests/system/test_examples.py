"""Every script in examples/ runs (at its --smoke size), from outside the checkout, so none rots."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # examples choose their own device count
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "an example shows what it did"
