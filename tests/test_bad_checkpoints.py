"""Checkpoint files users bring from elsewhere, damaged or wrapped: each is one line at the command line (exit 2),
naming the file, before anything is written; a wrapped torchvision state dict is recognised for what it is."""

import json
import shutil

import jax
import numpy as np
import pytest

from jaxnn import cli
from jaxnn.interop.hf import save_hf
from jaxnn.interop.tensors import TensorMismatchError, read_tensors
from jaxnn.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, seq_len=32, d_model=32, num_layers=1, num_heads=2, tie_embeddings=True, norm_eps=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A byte-vocabulary GPT-2 folder, as save_hf writes it."""
    out = tmp_path_factory.mktemp("hf") / "gpt2"
    save_hf(out, CFG, GPT(CFG).init(jax.random.key(0), (1, 8))[1])
    return out


def _broken(folder, tmp_path, change):
    copy = tmp_path / "broken"
    shutil.copytree(folder, copy)
    change(copy)
    return copy


def _refused(capsys, tmp_path, argv, match):
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run")] if argv[0] == "train" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda f: (f / "config.json").unlink(), "transformers weights without a config.json"),
        (lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:40]), "not JSON"),
        (lambda f: (f / "config.json").write_text(json.dumps({"n_embd": 32})), "no model_type"),
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
         "not a readable safetensors file"),
        (lambda f: (f / "model.safetensors").unlink(), "no weights (model.safetensors"),
        (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": '), "not a readable tokenizer.json"),
    ],
    ids=["no-config", "cut-config", "foreign-config", "cut-weights", "no-weights", "cut-tokenizer"],
)  # fmt: skip
def test_a_damaged_transformers_folder_is_one_line_for_train_and_generate(capsys, tmp_path, folder, change, match):
    broken = _broken(folder, tmp_path, change)
    _refused(capsys, tmp_path, ["train", "--init-from", str(broken), "--steps", "1"], match)
    _refused(capsys, tmp_path, ["generate", "--run-dir", str(broken), "--length", "2"], match)


@pytest.mark.slow
def test_the_intact_folder_trains_and_generates(capsys, tmp_path, folder):
    argv = ["train", "--init-from", str(folder), "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-plots", "--no-summary"]) == 0
    assert cli.main(["generate", "--run-dir", str(folder), "--length", "2"]) == 0


def test_torch_state_dicts_wrapped_or_prefixed_are_read_and_damaged_ones_refused(tmp_path):
    torch = pytest.importorskip("torch")
    state = {"conv1.weight": torch.ones(2, 3), "fc.bias": torch.zeros(4)}
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "dp.pth")  # nn.DataParallel's names
    torch.save({"epoch": 3, "state_dict": state, "optimizer": {"lr": 0.1}}, tmp_path / "wrapped.pth")
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in state.items()}}, tmp_path / "compiled.pth")
    for name in ("dp.pth", "wrapped.pth", "compiled.pth"):
        got = read_tensors(tmp_path / name)
        assert sorted(got) == ["conv1.weight", "fc.bias"] and np.array_equal(got["conv1.weight"], np.ones((2, 3)))
    (tmp_path / "cut.pth").write_bytes((tmp_path / "dp.pth").read_bytes()[:300])
    with pytest.raises(TensorMismatchError, match=r"cut\.pth: not a readable PyTorch file"):
        read_tensors(tmp_path / "cut.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(TensorMismatchError, match=r"list\.pth: holds a list, not a state dict"):
        read_tensors(tmp_path / "list.pth")
