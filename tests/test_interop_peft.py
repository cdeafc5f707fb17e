"""LoRA adapters in PEFT's layout, both ways, proven against PEFT itself on small random transformers models made
offline: jaxnn's adapters written with `save_peft` load in `PeftModel.from_pretrained` with jaxnn's logits, and a
folder PEFT wrote loads into jaxnn with PEFT's logits (fused q/k/v split, and PEFT's separate q, k, v adapters
fused)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import lora
from jaxnn.interop.hf import load_hf
from jaxnn.interop.peft import load_peft, save_peft
from jaxnn.models import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.xdist_group("transformers"), pytest.mark.slow]

from hf_models import CONFIGS, VOCAB, save_folders  # noqa: E402 (after the skips)

PEFT_TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama-gqa": ["q_proj", "v_proj", "down_proj"],
                "llama-tied-mha": ["k_proj"], "llama-biases-untied": ["o_proj", "up_proj"]}  # fmt: skip
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 10))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(tmp_path_factory)


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def _gap(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_jaxnn_adapters_load_in_peft_with_jaxnns_logits(folders, kind, tmp_path):
    cfg, base = load_hf(folders[kind])
    settings = lora.LoRA(rank=4, alpha=8, targets=("*attention*.w", "*mlp*.w"))
    params = lora.add_adapters(jax.tree.map(jnp.asarray, base), settings, jax.random.key(1))
    # Trained adapters: b away from its zero start, so every module's share of the update shows.
    moved = {k: (jax.random.normal(jax.random.key(i), v.shape) * 0.2 if k.endswith("lora_b") else v)
             for i, (k, v) in enumerate(lora.adapters(params).items())}  # fmt: skip
    params = _with(params, moved)
    ours = np.asarray(GPT(cfg).apply(params, jnp.asarray(IDS)))
    save_peft(tmp_path / "adapter", cfg, params, settings, base_model=str(folders[kind]))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    base_model = transformers.AutoModelForCausalLM.from_pretrained(folders[kind]).eval()
    theirs = _torch_logits(peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval())
    assert _gap(ours, theirs) < 1e-5
    plain = np.asarray(GPT(cfg).apply(jax.tree.map(jnp.asarray, base), jnp.asarray(IDS)))
    assert _gap(plain, theirs) > 1e-3  # the adapters did change the logits


def _with(params, arrays):
    from jaxnn._src.pytree import flatten, unflatten

    flat = dict(flatten(params))
    flat.update(arrays)
    return unflatten(flat)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_peft_folder_loads_into_jaxnn_with_pefts_logits(folders, kind, tmp_path):
    base_model = transformers.AutoModelForCausalLM.from_pretrained(folders[kind]).eval()
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=PEFT_TARGETS[kind], init_lora_weights=False)
    model = peft.get_peft_model(base_model, config).eval()  # random A and B: a visible update
    theirs = _torch_logits(model)
    model.save_pretrained(tmp_path / "theirs")
    cfg, base = load_hf(folders[kind])
    params, settings = load_peft(tmp_path / "theirs", cfg, jax.tree.map(jnp.asarray, base))
    assert settings.scale == 3.0
    ours = np.asarray(GPT(cfg).apply(params, jnp.asarray(IDS)))
    assert _gap(ours, theirs) < 1e-5
    plain = np.asarray(GPT(cfg).apply(jax.tree.map(jnp.asarray, base), jnp.asarray(IDS)))
    assert _gap(plain, theirs) > 1e-3  # the adapters did change the logits


def test_what_jaxnn_cannot_read_is_refused_in_one_line(folders, tmp_path):
    base_model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama-tied-mha"]).eval()
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    peft.get_peft_model(base_model, config).save_pretrained(tmp_path / "dora")
    cfg, base = load_hf(folders["llama-tied-mha"])
    with pytest.raises(ValueError, match="use_dora=True"):
        load_peft(tmp_path / "dora", cfg, base)
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        load_peft(tmp_path, cfg, base)


def test_a_run_trains_on_the_adapters_of_a_peft_folder(tmp_path, capsys):
    from serve_models import save_served_folder

    from jaxnn import cli
    from jaxnn.checkpoint import load_params

    base = save_served_folder(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False)
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(tmp_path / "p")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "t.txt").write_text("the cat sat on the mat and the dog sat on the log\n" * 40)
    argv = ["train", "--init-from", str(base), "--adapters", str(tmp_path / "p"), "--data", str(tmp_path / "d"),
            "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--no-progress", "--no-plots",
            "--no-summary"]  # fmt: skip
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run")]) == 0
    cfg, plain = load_hf(base)
    given, settings = load_peft(tmp_path / "p", cfg, jax.tree.map(jnp.asarray, plain))
    trained = lora.adapters(load_params(str(tmp_path / "run")).params)
    assert set(trained) == set(lora.adapters(given)) and settings.rank == 4
    start = lora.adapters(given)
    moved = [k for k in trained if k.endswith("lora_b") and not np.allclose(trained[k], start[k])]
    assert moved and all(np.abs(trained[k] - start[k]).max() < 0.1 for k in moved)  # trained on from PEFT's values
    capsys.readouterr()
    assert cli.main([*argv, "--lora", "r=8", "--run-dir", str(tmp_path / "other")]) == 2
    assert "differs from the settings of --adapters" in capsys.readouterr().err
    assert cli.main(["train", "--adapters", str(tmp_path / "p"), "--steps", "1", "--run-dir", str(tmp_path / "x")]) == 2
    assert "needs --init-from a transformers folder" in capsys.readouterr().err
