"""Folders jaxnn writes whole (exports, `save_model`): a rerun replaces its own earlier export, and never a file the
user put beside it; the refusal is one line naming the file, and every file is byte-identical afterwards."""

import hashlib
import json
import pathlib

import jax
import pytest

import jaxnn.layers as L
from jaxnn._src.folders import MARKER, write_folder
from jaxnn.errors import RunDirError
from jaxnn.layers import init_model
from jaxnn.saving import save_model


def _digests(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _export(text: str):
    def fill(staging: pathlib.Path) -> None:
        (staging / "weights.bin").write_text(text)

    return fill


IDENTITY = {"format": "test export", "source": "/runs/a"}


def test_a_rerun_replaces_its_own_export_and_records_the_files_it_wrote(tmp_path):
    write_folder(tmp_path / "out", _export("one"), IDENTITY)
    write_folder(tmp_path / "out", _export("two"), IDENTITY)
    assert (tmp_path / "out" / "weights.bin").read_text() == "two"
    assert json.loads((tmp_path / "out" / MARKER).read_text()) == {**IDENTITY, "files": ["weights.bin"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or set-aside folder left


@pytest.mark.parametrize("marker", ["lists its files", "from before file lists"])
def test_a_file_the_user_added_beside_an_export_stops_the_rerun_and_nothing_changes(tmp_path, marker):
    out = tmp_path / "out"
    write_folder(out, _export("one"), IDENTITY)
    if marker == "from before file lists":
        (out / MARKER).write_text(json.dumps(IDENTITY))
    (out / "README.md").write_text("my notes")
    before = _digests(out)
    with pytest.raises(RunDirError, match=r"files it did not write \(README.md\)") as err:
        write_folder(out, _export("two"), IDENTITY)
    assert "\n" not in str(err.value)
    assert _digests(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_model_over_an_earlier_save_keeps_the_users_notes(tmp_path):
    model = L.serial(L.Dense(4), L.Relu, L.Dense(2))
    params = init_model(model, jax.random.key(0), (1, 3))[1]
    save_model(tmp_path / "m", model, params)
    save_model(tmp_path / "m", model, params)  # its own earlier save: replaced
    (tmp_path / "m" / "notes.txt").write_text("trained on Tuesday")
    before = _digests(tmp_path / "m")
    with pytest.raises(RunDirError, match="notes.txt"):
        save_model(tmp_path / "m", model, params)
    assert _digests(tmp_path / "m") == before
