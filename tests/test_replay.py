"""`jaxnn train --config FILE` (jaxnn.cli.replay): a run's config.json replayed gives the same final parameters
bitwise; flags beside it override it; a file with unknown keys is refused in one line."""

import json

import pytest

from jaxnn import cli

QUICK = ["--model", "mlp", "--size", "small", "--steps", "4", "--batch-size", "16", "--no-progress", "--no-plots",
         "--no-summary", "--no-compile-cache", "--eval-every", "4"]  # fmt: skip


def _summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
def test_config_replays_a_run_bitwise_and_flags_override_it(tmp_path, capsys):
    first = tmp_path / "first"
    original = [*QUICK, "--lr", "0.01", "--seed", "3", "--clip-norm", "0.5", "--model-config", "hidden=[24]"]
    assert cli.main(["train", *original, "--run-dir", str(first)]) == 0
    again = tmp_path / "again"
    assert cli.main(["train", "--config", str(first / "config.json"), "--run-dir", str(again), "--no-progress",
                     "--no-plots", "--no-summary", "--no-compile-cache", "--eval-every", "4"]) == 0  # fmt: skip
    a, b = _summary(first), _summary(again)
    assert a["param_digest"] == b["param_digest"] and a["eval_loss"] == b["eval_loss"]
    assert json.loads((first / "config.json").read_text()) == json.loads((again / "config.json").read_text())
    # A flag given beside --config wins, even at its default value (the file's seed is 3, the default 0).
    other = tmp_path / "other"
    assert cli.main(["train", "--config", str(first / "config.json"), "--seed", "0", "--run-dir", str(other),
                     "--no-progress", "--no-plots", "--no-summary", "--no-compile-cache"]) == 0  # fmt: skip
    assert json.loads((other / "config.json").read_text())["seed"] == 0
    assert json.loads((other / "config.json").read_text())["lr"] == 0.01


def test_a_config_file_with_unknown_keys_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": "mlp", "learning_rate": 0.1}))
    assert cli.main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key(s) ['learning_rate']" in err[0]
    assert not (tmp_path / "run").exists()
