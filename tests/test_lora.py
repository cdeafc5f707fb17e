"""LoRA adapters (jaxnn.lora): exactness at the start, merging, what trains, the optimizer's state, resume,
targets no Dense reads, the settings' text and the adapter file."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnn
from jaxnn import lora
from jaxnn._src.pytree import flatten, unflatten
from jaxnn.config import ConfigError
from jaxnn.generate import generate_tokens
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.train import lm_loss

CFG = GPTConfig(vocab_size=48, seq_len=16, d_model=32, num_layers=2, num_heads=2)


def _ids(seed=0, shape=(4, 12)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape), jnp.int32)


def _moved(params, seed=1, size=0.1):
    """`params` with every lora_b set to random values, as training would leave them."""
    rng = np.random.default_rng(seed)
    flat = {k: (rng.normal(0, size, np.shape(v)).astype(np.float32) if k.endswith("lora_b") else v)
            for k, v in flatten(params).items()}  # fmt: skip
    return unflatten(flat)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_zero_adapters_give_exactly_the_base_logits_and_merging_matches_the_adapted_model(scan):
    model = GPT(dataclasses.replace(CFG, scan_layers=scan))
    _, params = model.init(jax.random.key(0), (1, 8))
    adapted = lora.add_adapters(params, lora.LoRA(rank=4), jax.random.key(1))
    names = lora.target_names(params, lora.DEFAULT_TARGETS)
    assert len(names) == (4 if scan else 8)  # qkv, out, fc, proj per block (stacked under scan)
    assert np.array_equal(model.apply(adapted, _ids()), model.apply(params, _ids()))
    trained = _moved(adapted)
    unmerged, merged = model.apply(trained, _ids()), model.apply(lora.merge(trained), _ids())
    assert np.abs(unmerged - model.apply(params, _ids())).max() > 0.1  # the adapters do change the model
    assert np.abs(unmerged - merged).max() < 1e-5
    assert not lora.has_adapters(lora.merge(trained))


def _data(n=32):
    x = np.asarray(_ids(5, (n, 12)))
    return {"x": x, "y": np.roll(x, -1, axis=1)}


def _fit(params, tmp_path=None, **kw):
    return jaxnn.fit(GPT(CFG), _data(), loss=lm_loss, params=params, batch_size=8, progress=False, plots=False,
                     optimizer=optax.adam(1e-2), **kw)  # fmt: skip


@pytest.mark.slow
def test_fit_with_lora_trains_the_adapters_alone_and_keeps_no_optimizer_state_for_the_base():
    _, base = GPT(CFG).init(jax.random.key(0), (1, 8))
    result = _fit(base, steps=3, lora="r=4,alpha=8")
    params = result.state.params
    for name, value in flatten(base).items():
        assert np.array_equal(np.asarray(flatten(params)[name]), np.asarray(value)), f"{name} changed"
    moved = [n for n, v in lora.adapters(params).items() if n.endswith("lora_b") and np.abs(v).max() > 0]
    assert len(moved) == 8
    state_arrays = [x for x in jax.tree.leaves(result.state.opt_state) if np.ndim(x) > 0]
    adapter_size = sum(np.size(v) for n, v in lora.adapters(params).items() if not n.endswith("lora_scale"))
    assert sum(np.size(x) for x in state_arrays) == 2 * adapter_size  # Adam's two moments, of the adapters only
    assert result.summary.get("final_loss", 0) == result.summary.get("final_loss", 0)


@pytest.mark.slow
def test_a_lora_run_resumes_bitwise(tmp_path):
    _, base = GPT(CFG).init(jax.random.key(0), (1, 8))
    straight = _fit(base, steps=4, lora="r=4,dropout=0.1", run_dir=str(tmp_path / "a"))
    _fit(base, steps=2, lora="r=4,dropout=0.1", run_dir=str(tmp_path / "b"), ckpt_every=2)
    resumed = _fit(base, steps=4, lora="r=4,dropout=0.1", run_dir=str(tmp_path / "b"), resume=True)
    for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="lora"):  # other adapter settings are another run
        _fit(base, steps=4, lora="r=8", run_dir=str(tmp_path / "b"), resume=True)


def test_targets_that_no_dense_layer_multiplies_are_refused_before_training():
    from jaxnn.models import CNN

    images = np.random.default_rng(0).normal(size=(16, 8, 8, 1)).astype(np.float32)
    labels = np.arange(16) % 10
    with pytest.raises(ConfigError, match=r"LoRA targets .*conv.*\.w.*no Dense layer multiplies"):
        jaxnn.fit(CNN(), (images, labels), steps=1, batch_size=8, progress=False, lora="targets=*conv*")
    with pytest.raises(ConfigError, match="no Dense weight matches targets"):
        jaxnn.fit(CNN(), (images, labels), steps=1, batch_size=8, progress=False, lora="targets=*nothing*")


def test_the_settings_text_and_its_refusals():
    got = lora.parse_lora("r=16, alpha=32, dropout=0.05, targets=*qkv.w,*out.w")
    assert got == lora.LoRA(rank=16, alpha=32.0, dropout=0.05, targets=("*qkv.w", "*out.w"))
    assert lora.parse_lora("rank=4").targets == lora.DEFAULT_TARGETS
    assert lora.as_lora(got.record()) == got
    for bad, message in [("r=0", "rank"), ("r=two", "not a number"), ("alpha=-1", "alpha"), ("dropout=1", "dropout"),
                         ("size=3", "unknown setting")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            lora.parse_lora(bad)


@pytest.mark.slow
def test_adapters_save_alone_and_load_onto_the_same_base_only(tmp_path):
    model = GPT(CFG)
    _, base = model.init(jax.random.key(0), (1, 8))
    settings = lora.LoRA(rank=2, alpha=4, targets=("*qkv.w",))
    trained = _moved(lora.add_adapters(base, settings, jax.random.key(1)))
    path = lora.save_adapters(tmp_path / "adapters.safetensors", trained, settings)
    loaded, got = lora.load_adapters(path, base)
    assert got == settings
    assert np.array_equal(model.apply(loaded, _ids()), model.apply(trained, _ids()))
    other = GPT(dataclasses.replace(CFG, d_model=16)).init(jax.random.key(0), (1, 8))[1]
    with pytest.raises(ValueError, match="another base model"):
        lora.load_adapters(path, {"0_embed": other["0_embed"]})
    # Another checkpoint of the same shapes: its adapted weights differ from those the file recorded.
    _, same_shapes = model.init(jax.random.key(7), (1, 8))
    with pytest.raises(ValueError, match="trained on another base"):
        lora.load_adapters(path, same_shapes)
    forced, _ = lora.load_adapters(path, same_shapes, check_base=False)
    assert np.array_equal(lora.adapters(forced)["2_block.0_attn.1_attention.qkv.lora_b"],
                          lora.adapters(trained)["2_block.0_attn.1_attention.qkv.lora_b"])  # fmt: skip


@pytest.mark.slow
def test_generation_from_unmerged_and_merged_adapters_gives_the_same_tokens():
    model = GPT(CFG)
    _, base = model.init(jax.random.key(0), (1, 8))
    trained = _moved(lora.add_adapters(base, lora.LoRA(rank=4), jax.random.key(1)), size=0.05)
    kw = {"temperature": 0.0, "context_len": CFG.seq_len}
    unmerged = generate_tokens(model, trained, [1, 2, 3], 10, **kw)
    assert unmerged == generate_tokens(model, lora.merge(trained), [1, 2, 3], 10, **kw)
    assert unmerged != generate_tokens(model, base, [1, 2, 3], 10, **kw)


@pytest.mark.slow
def test_the_frozen_base_gets_no_weight_gradient_products_in_the_compiled_step():
    import re

    from jaxnn.train import create_train_state, make_train_step

    settings = lora.LoRA(rank=4)
    tx = lora.train_adapters_only(optax.adam(1e-3))
    batch = {"x": _ids(), "y": _ids(1)}

    def dots(model):
        state = create_train_state(lora.with_adapters(GPT(CFG), settings), tx, jax.random.key(0), (4, 12))
        text = make_train_step(model, lm_loss, tx).lower(state, batch).compile().as_text()
        return len(re.findall(r" dot\(", text))

    plain = GPT(CFG)  # the same params with adapters, but gradients flow into the base
    frozen, open_base = dots(lora.lora_model(plain, settings)), dots(plain)
    # 2 blocks x 4 weights, plus the output layer: each frozen weight loses its one weight-gradient product.
    assert open_base - frozen >= 2 * 4, (open_base, frozen)


def test_every_form_of_the_settings_reads_a_pattern_as_a_pattern():
    text = lora.as_lora("r=4,targets=*1_dense.w")
    assert lora.as_lora({"rank": 4, "targets": "*1_dense.w"}) == text  # one pattern, not one per character
    assert lora.as_lora({"r": 4, "targets": ["*1_dense.w"]}) == text
    assert lora.as_lora(lora.LoRA(rank=4, targets="*1_dense.w")) == text
    with pytest.raises(ValueError, match="unknown setting 'size'"):
        lora.as_lora({"rank": 4, "size": 3})


def test_a_cut_adapter_file_is_one_line_naming_it(tmp_path):
    _, base = GPT(CFG).init(jax.random.key(0), (1, 8))
    settings = lora.LoRA(rank=2, targets=("*qkv.w",))
    path = lora.save_adapters(
        tmp_path / "a.safetensors", lora.add_adapters(base, settings, jax.random.key(1)), settings
    )
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="a.safetensors: not a readable adapter file") as err:
        lora.load_adapters(path, base)
    assert "\n" not in str(err.value)
