"""transformers GPT-2 and Llama checkpoints into jaxnn and back, proven against transformers' own forward pass on
small random models created offline (every tensor randomised, norms included, so a misplaced one shows)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn.interop.hf import load_hf, save_hf
from jaxnn.interop.tensors import TensorMismatchError
from jaxnn.models import GPT
from jaxnn.models.presets import PRESETS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import CONFIGS, VOCAB, save_folders  # noqa: E402 (after the skips)

pytestmark = pytest.mark.xdist_group("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(tmp_path_factory)


def _batch():
    ids = np.random.default_rng(1).integers(0, VOCAB, (3, 12))
    mask = np.ones(ids.shape, bool)
    mask[1, 8:] = False  # padded rows: their real positions must still agree
    mask[2, 5:] = False
    return ids, mask


def _reference_logits(folder, ids, mask):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))).logits.numpy()


def _jaxnn_logits(cfg, params, ids, mask):
    return np.asarray(GPT(cfg).apply(jax.tree.map(jnp.asarray, params), jnp.asarray(ids), mask=jnp.asarray(mask)))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.slow
def test_imported_logits_equal_transformers_on_a_padded_batch(folders, kind):
    cfg, params = load_hf(folders[kind])
    ids, mask = _batch()
    err = np.abs(_jaxnn_logits(cfg, params, ids, mask) - _reference_logits(folders[kind], ids, mask))[mask].max()
    assert err < 2e-5, f"{kind}: max abs error {err:.3g} against transformers"
    n_ref = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folders[kind]).parameters())
    assert cfg.num_params() == n_ref


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_jaxnn_params_saved_as_a_folder_load_in_transformers_with_the_same_logits(folders, kind, tmp_path):
    cfg, params = load_hf(folders[kind])
    ids, mask = _batch()
    save_hf(tmp_path / "out", cfg, params)
    err = np.abs(_reference_logits(tmp_path / "out", ids, mask) - _reference_logits(folders[kind], ids, mask))
    assert err[mask].max() == 0.0, f"{kind}: round trip changed the logits by {err[mask].max():.3g}"


@pytest.mark.slow
def test_a_model_trained_in_jaxnn_saves_as_llama_and_transformers_agrees(tmp_path):
    cfg = dataclasses.replace(PRESETS["tinyllama-1.1b"].config, vocab_size=64, d_model=32, num_layers=1,
                              num_heads=4, num_kv_heads=2, mlp_hidden=24)  # fmt: skip
    _, params = GPT(cfg).init(jax.random.key(3), (1, 8))
    save_hf(tmp_path / "mine", cfg, params)
    ids, mask = _batch()
    ids = ids % 64
    err = np.abs(_reference_logits(tmp_path / "mine", ids, mask) - _jaxnn_logits(cfg, params, ids, mask))[mask].max()
    assert err < 2e-5, f"max abs error {err:.3g}"


@pytest.mark.slow
def test_every_parameter_of_an_export_has_a_rule_or_the_export_is_refused(tmp_path):
    cfg = dataclasses.replace(PRESETS["gpt2"].config, vocab_size=64, seq_len=16, d_model=32, num_layers=1,
                              num_heads=2, tie_embeddings=False, logits_bias=True)  # fmt: skip
    _, params = GPT(cfg).init(jax.random.key(0), (1, 8))
    with pytest.raises(ValueError, match="bias on its logits"):
        save_hf(tmp_path / "a", cfg, params)
    plain = dataclasses.replace(cfg, logits_bias=False)
    _, params = GPT(plain).init(jax.random.key(0), (1, 8))
    params["2_block"]["1_mlp"]["1_fc"]["extra"] = np.zeros(3, np.float32)  # a parameter no rule knows
    with pytest.raises(TensorMismatchError, match="2_block/1_mlp/1_fc/extra has no place in a transformers gpt2"):
        save_hf(tmp_path / "b", plain, params)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_run_saved_before_logits_bias_rebuilds_with_its_bias():
    from jaxnn.models.factory import model_from_record

    record = {"model": "gpt", "model_config": {"vocab_size": 32, "d_model": 16, "num_layers": 1, "num_heads": 2}}
    _, cfg = model_from_record(record)
    assert cfg.logits_bias and cfg.bias
    _, cfg = model_from_record({**record, "model_config": {**record["model_config"], "bias": False}})
    assert not cfg.logits_bias


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
def test_a_lora_fine_tune_exports_merged_and_transformers_gives_jaxnns_logits(folders, kind, tmp_path):
    import optax

    import jaxnn
    from jaxnn.train import lm_loss

    cfg, params = load_hf(folders[kind])
    x = np.random.default_rng(2).integers(0, VOCAB, (16, 12))
    result = jaxnn.fit(GPT(cfg), {"x": x, "y": np.roll(x, -1, axis=1)}, loss=lm_loss, params=params, steps=3,
                       batch_size=8, optimizer=optax.adam(3e-2), lora="r=4,alpha=8", progress=False)  # fmt: skip
    trained = result.state.params
    save_hf(tmp_path / "out", cfg, trained)
    ids, mask = _batch()
    ours = _jaxnn_logits(cfg, trained, ids, mask)
    assert np.abs(ours - _jaxnn_logits(cfg, params, ids, mask))[mask].max() > 1e-3  # the adapters trained
    err = np.abs(_reference_logits(tmp_path / "out", ids, mask) - ours)[mask].max()
    assert err < 1e-4, f"{kind}: transformers' logits of the merged export differ by {err:.3g}"


@pytest.mark.slow
def test_a_bf16_load_gives_bf16_params_close_to_fp32(folders):
    cfg, params = load_hf(folders["llama-gqa"], dtype=jnp.bfloat16)
    assert {str(a.dtype) for a in jax.tree.leaves(params)} == {"bfloat16"}
    ids, mask = _batch()
    ref = _reference_logits(folders["llama-gqa"], ids, mask)
    err = np.abs(_jaxnn_logits(cfg, params, ids, mask).astype(np.float32) - ref)[mask].max()
    assert err < 0.1 * np.abs(ref).max(), f"bf16 max abs error {err:.3g}"


def _rewrite(folder, tmp_path, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    out = tmp_path / "broken"
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((folder / "config.json").read_text())
    return out


def test_a_missing_unexpected_or_misshapen_tensor_is_named(folders, tmp_path):
    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]

    with pytest.raises(TensorMismatchError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf(_rewrite(folders["llama-gqa"], tmp_path / "a", drop))

    def add(t):
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)

    with pytest.raises(TensorMismatchError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_hf(_rewrite(folders["llama-gqa"], tmp_path / "b", add))

    def shrink(t):
        t["transformer.h.0.mlp.c_fc.weight"] = t["transformer.h.0.mlp.c_fc.weight"][:, :-1]

    with pytest.raises(TensorMismatchError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \(32, 127\)"):
        load_hf(_rewrite(folders["gpt2"], tmp_path / "c", shrink))


def test_an_architecture_jaxnn_does_not_model_is_refused_in_one_line(folders, tmp_path):
    config = json.loads((folders["llama-gqa"] / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    folder = tmp_path / "scaled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        load_hf(folder)


def test_save_hf_never_writes_into_a_folder_that_holds_files(folders, tmp_path):
    from jaxnn._src.storage import RunDirError

    cfg, params = load_hf(folders["gpt2"])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"holds files that are not a jaxnn export \(notes\.txt\)"):
        save_hf(tmp_path, cfg, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    with pytest.raises(RunDirError, match="holds files that are not a jaxnn export"):
        save_hf(folders["gpt2"], cfg, params)  # the checkpoint it was read from is never written over


def test_an_export_replaces_its_own_earlier_one_whole_and_survives_a_kill_or_a_full_disk(folders, tmp_path):
    import safetensors.numpy

    from jaxnn._src.storage import RunDirError, StorageError

    cfg, params = load_hf(folders["gpt2"])
    out = tmp_path / "out"
    save_hf(out, cfg, params, source="run-a")
    before = (out / "model.safetensors").read_bytes()
    changed = jax.tree.map(lambda a: a * 0 + 1, params)
    save_hf(out, cfg, changed, source="run-a")  # its own earlier export: replaced
    assert (out / "model.safetensors").read_bytes() != before
    with pytest.raises(RunDirError, match="holds another export"):
        save_hf(out, cfg, params, source="run-b")
    # A kill between setting the old folder aside and moving the new one in: the rerun puts the old one back first.
    (tmp_path / ".out.partial-99999").mkdir()
    out.rename(tmp_path / ".out.old-99999")
    save_hf(out, cfg, params, source="run-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    now = (out / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkey = pytest.MonkeyPatch()
    monkey.setattr(safetensors.numpy, "save_file", full_disk)
    try:
        with pytest.raises(StorageError, match="writing .*out"):
            save_hf(out, cfg, changed, source="run-a")
    finally:
        monkey.undo()
    assert (out / "model.safetensors").read_bytes() == now and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.family == "gpt"])
def test_each_decoder_preset_has_its_published_parameter_count(name):
    preset = PRESETS[name]
    model = GPT(preset.config)
    shapes = jax.eval_shape(lambda key: model.init(key, (1, 1))[1], jax.random.key(0))
    assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes)) == preset.published_params


def _eos_tokenizer_folder(folder):
    """A word-level tokenizer whose end-of-text token is special, as GPT-2's is, and a tokenizer_config.json naming
    it (with a chat template, which an export must keep)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", *[f"w{i}" for i in range(VOCAB - 2)], "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, 0


@pytest.mark.slow
def test_an_hf_export_says_where_generation_ends_and_transformers_stops_where_jaxnn_does(tmp_path, capsys):
    from jaxnn import cli

    tokenizer_folder, eos = _eos_tokenizer_folder(tmp_path / "tok")
    cfg = dataclasses.replace(PRESETS["gpt2"].config, vocab_size=VOCAB, seq_len=32, d_model=32, num_layers=1,
                              num_heads=2, tie_embeddings=False)  # fmt: skip
    _, params = GPT(cfg).init(jax.random.key(0), (1, 8))
    # The final norm outputs a constant vector whose product with the end token's output column beats every other:
    # greedy generation emits the end token next, whatever the prompt.
    params["3_ln_f"] = {"scale": jnp.zeros(32), "bias": jnp.ones(32)}
    params["4_logits"]["w"] = jnp.zeros((32, VOCAB)).at[:, eos].set(1.0)
    out = tmp_path / "export"
    save_hf(out, cfg, params, tokenizer_from=tokenizer_folder)

    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert ids[0].tolist() == [5, 6, 7, eos]  # stopped at the end token, not after 6 tokens

    argv = ["generate", "--run-dir", str(out), "--prompt", "w4 w5 w6", "--length", "6", "--temperature", "0"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == "w4 w5 w6"  # the end token ended it (and decodes to nothing)
