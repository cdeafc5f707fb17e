"""LoRA over a quantised base: codes and scales against numpy references written here, products against the
dequantised weight, and fit/merge/adapters with an int8 or nf4 base."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnn
from jaxnn import lora, quantized
from jaxnn._src.pytree import flatten
from jaxnn.config import ConfigError
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.train import lm_loss

pytest.importorskip("qwix")

CFG = GPTConfig(vocab_size=48, seq_len=16, d_model=32, num_layers=2, num_heads=2)
# The 16 NormalFloat4 levels as the QLoRA paper lists them (Dettmers et al. 2023, appendix E).
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)  # fmt: skip


def _weight(shape=(2, 128, 24), seed=0):
    return np.random.default_rng(seed).normal(0, 0.05, shape).astype(np.float32)


def _int8_reference(w):
    # absmax maps to 127.5, the edge of the top bucket, so that 127 is used as often as the other codes
    scale = np.abs(w).max(axis=-2, keepdims=True) / 127.5
    return np.clip(np.round(w / scale), -128, 127) * scale


def _nf4_reference(w, block=64):
    *stack, fan_in, out = w.shape
    blocks = w.reshape(*stack, fan_in // block, block, out)
    absmax = np.abs(blocks).max(axis=-2, keepdims=True)
    nearest = NF4[np.abs(blocks[..., None] / absmax[..., None] - NF4).argmin(-1)]
    return (nearest * absmax).reshape(w.shape)


@pytest.mark.parametrize("base,reference", [("int8", _int8_reference), ("nf4", _nf4_reference)])
def test_codes_and_scales_match_a_numpy_reference_per_channel_and_per_block(base, reference):
    w = _weight()
    codes, scale = quantized.quantize_weight(w, base)
    restored = np.asarray(quantized.dequantize_weight(codes, scale))
    differ = ~np.isclose(restored, reference(w), rtol=1e-5, atol=1e-7)
    # Only a channel's own absmax sits on a tie between two int8 codes (127.5); its rounding is float noise.
    at_absmax = np.abs(w) == np.abs(w).max(axis=-2, keepdims=True)
    assert differ.sum() <= at_absmax.sum() and not (differ & ~at_absmax).any()
    assert quantized.weight_shape(codes) == w.shape
    stored = codes.nbytes / w.size
    assert stored == {"int8": 1.0, "nf4": 0.5}[base]  # two nf4 codes a byte


def test_the_relative_error_of_each_base_on_gaussian_weights():
    w = _weight((4, 256, 64))
    errors = {}
    for base in quantized.BASES:
        restored = np.asarray(quantized.dequantize_weight(*quantized.quantize_weight(w, base)))
        errors[base] = np.linalg.norm(restored - w) / np.linalg.norm(w)
    assert errors["int8"] < 0.01 and 0.04 < errors["nf4"] < 0.12, errors


@pytest.mark.parametrize("base", quantized.BASES)
def test_a_dense_product_with_a_stored_base_equals_the_product_with_its_dequantised_weight_and_differentiates(base):
    w = _weight((64, 24))[None]
    codes, scale = quantized.quantize_weight(w, base)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 64)), jnp.float32)
    dense = np.asarray(quantized.dequantize_weight(codes, scale))[0]
    np.testing.assert_allclose(quantized.dense_product(x, codes[0], scale[0], None), x @ dense, rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda x: quantized.dense_product(x, codes[0], scale[0], None).sum())(x)
    np.testing.assert_allclose(grad, np.broadcast_to(dense.sum(-1), x.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_a_quantised_base_keeps_the_model_s_logits_within_its_error_and_merges_to_plain_weights(scan):
    model = GPT(dataclasses.replace(CFG, scan_layers=scan))
    _, params = model.init(jax.random.key(0), (1, 8))
    ids = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (4, 12)), jnp.int32)
    full = np.asarray(model.apply(params, ids))
    # Measured on this 32-wide random model: int8 1.0-1.3%, nf4 19-24% (few inputs a channel, errors compound).
    for base, bound in (("int8", 0.02), ("nf4", 0.3)):
        settings = lora.LoRA(rank=4, base=base)
        stored = lora.quantize_base(lora.add_adapters(params, settings, jax.random.key(1)), settings)
        assert quantized.is_quantized(stored)
        assert not any(n.endswith(".w") and "attention" in n for n in flatten(stored))
        logits = np.asarray(model.apply(stored, ids))
        assert np.linalg.norm(logits - full) / np.linalg.norm(full) < bound, base
        merged = lora.merge(stored)  # dequantised, adapters folded in: a plain model that exports anywhere
        assert not quantized.is_quantized(merged) and not lora.has_adapters(merged)
        np.testing.assert_allclose(model.apply(merged, ids), logits, rtol=1e-4, atol=1e-4)


def _data(n=32):
    x = np.random.default_rng(5).integers(0, CFG.vocab_size, (n, 12))
    return {"x": x, "y": np.roll(x, -1, axis=1)}


@pytest.mark.slow
@pytest.mark.parametrize("base", quantized.BASES)
def test_fit_trains_adapters_over_a_quantised_base_that_never_changes(base):
    _, params = GPT(CFG).init(jax.random.key(0), (1, 8))
    result = jaxnn.fit(GPT(CFG), _data(), loss=lm_loss, params=params, batch_size=8, steps=6, progress=False,
                       plots=False, optimizer=optax.adam(1e-2), lora={"rank": 4, "base": base})  # fmt: skip
    trained = flatten(result.state.params)
    expected = flatten(lora.quantize_base(params, lora.LoRA(base=base)))
    codes = [n for n in trained if n.endswith((".w_q", ".w_scale"))]
    assert len(codes) == 16  # qkv, out, fc, proj of two blocks, codes and scales each
    for name in codes:
        assert np.array_equal(np.asarray(trained[name]), np.asarray(expected[name])), name
    assert any(np.abs(v).max() > 0 for n, v in trained.items() if n.endswith("lora_b"))
    data = {k: jnp.asarray(v) for k, v in _data().items()}
    start = lora.add_adapters(lora.quantize_base(params, lora.LoRA(base=base)), lora.LoRA(rank=4), jax.random.key(0))
    before, after = (float(lm_loss(GPT(CFG).apply(p, data["x"]), data)[0]) for p in (start, result.state.params))
    assert after < before - 0.01, (before, after)
    # The start-of-run block counts the base's parameters as the full-precision model has them.
    full = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params))
    adapters = sum(int(np.size(v)) for n, v in trained.items() if n.endswith(("lora_a", "lora_b")))
    levers = result.summary["levers"]
    assert (levers["trainable_params"], levers["frozen_params"]) == (adapters, full)


@pytest.mark.parametrize("base", quantized.BASES)
def test_a_quantised_weight_counts_as_many_parameters_as_its_full_precision_weight(base):
    # nf4 stores two codes a byte and both bases add scales: neither changes how many parameters the model has
    params = {"dense": {"w": np.ones((64, 6), np.float32), "b": np.zeros(6, np.float32)}, "norm": {"g": np.ones(6)}}
    stored = quantized.quantize_params(params, ["dense.w"], base)
    assert set(flatten(stored)) == {"dense.w_q", "dense.w_scale", "dense.b", "norm.g"}
    assert quantized.parameter_count(stored) == quantized.parameter_count(params) == 64 * 6 + 6 + 6


def test_adapters_trained_on_a_quantised_base_load_onto_the_full_precision_checkpoint(tmp_path):
    _, params = GPT(CFG).init(jax.random.key(0), (1, 8))
    settings = lora.LoRA(rank=4, base="int8")
    stored = lora.quantize_base(lora.add_adapters(params, settings, jax.random.key(1)), settings)
    path = lora.save_adapters(tmp_path / "a.safetensors", stored, settings)
    loaded, read = lora.load_adapters(path, params)  # the base quantised as it was trained on it
    assert read.base == "int8"
    for name, value in flatten(stored).items():
        assert np.array_equal(np.asarray(flatten(loaded)[name]), np.asarray(value)), name
    _, other = GPT(CFG).init(jax.random.key(7), (1, 8))
    with pytest.raises(ValueError, match="another base"):
        lora.load_adapters(path, other)


def test_bad_bases_are_one_line():
    with pytest.raises(ValueError, match=r"base='int4' is not a quantised base; give one of int8, nf4"):
        lora.parse_lora("r=4,base=int4")
    assert lora.parse_lora("r=4,base=nf4").record()["base"] == "nf4"
    assert "base" not in lora.LoRA().record()  # records of plain LoRA runs are as before
    with pytest.raises(ValueError, match="has 5 inputs; nf4 packs two codes a byte"):
        quantized.quantize_weight(np.ones((5, 4), np.float32), "nf4", "x.w")
    images, labels = np.zeros((16, 8, 8, 1), np.float32), np.zeros(16, np.int32)
    from jaxnn.models.cnn import CNN

    with pytest.raises(ConfigError, match="no Dense weight matches"):
        jaxnn.fit(CNN(), (images, labels), steps=1, batch_size=8, progress=False, lora="base=int8,targets=*nothing*")
