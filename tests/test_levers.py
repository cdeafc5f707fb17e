"""The block a run starts with (jaxnn.loop._levers): parameter counts, packing efficiency, remat and the compiled
step's memory, whether the precision pays, the clip norm; in the log and in summary.json."""

import json
import logging

import jax
import numpy as np
import optax
import pytest

import jaxnn
import jaxnn.layers as L
from jaxnn.config import ConfigError
from jaxnn.data.packing import pack_documents
from jaxnn.errors import PrecisionWarning
from jaxnn.loop import _levers
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.train import lm_loss

CFG = GPTConfig(vocab_size=48, seq_len=16, d_model=16, num_layers=1, num_heads=2)
QUICK = {"steps": 1, "batch_size": 8, "progress": False, "plots": False}


def _text(n=16):
    x = np.random.default_rng(5).integers(0, CFG.vocab_size, (n, 16)).astype(np.int32)
    return {"x": x, "y": np.roll(x, -1, axis=1)}


def _block(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxnn.levers"]


def _numpy_count(tree) -> int:
    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree))


def test_a_lora_run_starts_with_its_trainable_and_frozen_counts(caplog):
    caplog.set_level(logging.INFO, logger="jaxnn.levers")
    x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    model = L.serial(L.Dense(16), L.Relu, L.Dense(2))  # a GPT's attention and MLP weights are Dense layers alike
    result = jaxnn.fit(model, (x, (x[:, 0] > 0).astype(np.int32)), lora="r=4,targets=*.w", **QUICK)
    flat = jaxnn.lora.adapters(result.state.params)
    trained = sum(int(np.prod(np.shape(v))) for k, v in flat.items() if k.endswith(("lora_a", "lora_b")))
    frozen = _numpy_count(result.state.params) - _numpy_count(flat)  # the base alone: scales are constants
    levers = result.summary["levers"]
    assert (levers["trainable_params"], levers["frozen_params"]) == (trained, frozen)
    block = _block(caplog)
    assert len(block) == 5 and f"{trained:,} trainable, {frozen:,} frozen" in block[0]
    assert levers["clip_norm"] == 1.0 and "clip norm 1.0" in block[4]  # the default optimizer's clip


@pytest.mark.slow
def test_a_packed_run_reports_the_share_of_real_tokens(caplog):
    caplog.set_level(logging.INFO, logger="jaxnn.levers")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, CFG.vocab_size, n).astype(np.int32) for n in (5, 9, 12, 17, 3, 8, 11, 6)]
    packed = pack_documents(docs, 16)
    real_pairs = sum(len(d) - 1 for d in docs)  # each document of n tokens gives n - 1 (input, target) pairs
    expected = real_pairs / packed.arrays["x"].size
    result = jaxnn.fit(GPT(CFG), packed.arrays, loss=lm_loss, **{**QUICK, "batch_size": 2})
    assert result.summary["levers"]["packing_efficiency"] == pytest.approx(expected)
    assert f"packing efficiency {100 * expected:.1f}%" in _block(caplog)[1]


def test_a_remat_run_reports_its_policy_and_the_compiled_steps_memory(caplog):
    caplog.set_level(logging.INFO, logger="jaxnn.levers")
    x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = L.serial(L.Dense(16), L.Relu, L.Dense(2))
    result = jaxnn.fit(model, (x, y), remat="dots", optimizer=optax.adam(1e-2), **QUICK)
    levers = result.summary["levers"]
    assert levers["remat"] == "dots" and levers["trainable_params"] == 8 * 16 + 16 + 16 * 2 + 2
    assert levers["frozen_params"] == 0 and levers["clip_norm"] is None  # optax.adam clips nothing
    assert isinstance(levers["step_temp_bytes"], int) and levers["step_temp_bytes"] >= 0
    assert "remat dots; compiled step's temporary memory" in _block(caplog)[2]
    # A model whose config holds the policy (`jaxnn train --remat`) reports it too.
    import dataclasses

    assert _levers.remat_of(None, GPT(dataclasses.replace(CFG, remat="dots_no_batch"))) == "dots_no_batch"
    assert _levers.remat_of(None, GPT(dataclasses.replace(CFG, remat=True))) == "nothing"


def test_an_fp8_run_on_a_cpu_warns_with_the_rule(caplog):
    caplog.set_level(logging.INFO, logger="jaxnn.levers")
    with pytest.warns(PrecisionWarning, match=r"fp8 on a CPU.*slower than bf16"):
        x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
        result = jaxnn.fit(L.serial(L.Dense(16), L.Relu, L.Dense(2)), (x, (x[:, 0] > 0).astype(np.int32)),
                           precision="fp8", **QUICK)  # fmt: skip
    levers = result.summary["levers"]
    assert levers["precision"] == "fp8" and levers["precision_pays"] is False
    assert "precision fp8: does NOT pay" in _block(caplog)[3]


def test_bf16_pays_on_a_cpu_only_with_bf16_instructions(monkeypatch):
    advice = _levers.precision_advice
    assert advice("bf16", "cpu", frozenset({"avx2", "avx512f"})) is not None
    assert "avx512_bf16 or amx_bf16" in advice("bf16", "cpu", frozenset({"avx512f"}))
    assert advice("bf16", "cpu", frozenset({"avx512f", "avx512_bf16"})) is None
    assert advice("bf16", "cpu", frozenset({"amx_bf16"})) is None
    assert advice("fp8", "cpu", frozenset({"avx512_bf16", "amx_bf16"})) is not None  # fp8 never pays on a CPU
    assert advice("bf16", "gpu", frozenset()) is None and advice("fp32", "cpu", frozenset()) is None
    assert "fp16 on a CPU without avx512_fp16 or amx_fp16" in advice("fp16", "cpu", frozenset({"avx512_bf16"}))
    assert advice("fp16", "cpu", frozenset({"avx512_fp16"})) is None and advice("fp16", "gpu", frozenset()) is None
    # fp8 on a GPU: told where the products are narrower than fp8 has measured faster at, not where they are wide
    assert "fp8 with products 1024 wide" in advice("fp8", "gpu", frozenset(), width=1024)
    assert advice("fp8", "gpu", frozenset(), width=8192) is None and advice("bf16", "gpu", frozenset(), 64) is None
    wide = {"mlp": {"w": np.ones((3, 1024, 4096))}, "head": {"w": np.ones((1024, 64))}, "b": np.ones(5000)}
    assert _levers.product_width(wide) == 1024  # a GPT of d 1024: its MLP's 4096 is the wider side
    # A run on a CPU without the instructions (a patched feature list) warns, and its block says so.
    monkeypatch.setattr(_levers, "cpu_info", lambda: ("a CPU", frozenset({"avx2"}), 2))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    with pytest.warns(PrecisionWarning, match="bf16 on a CPU without avx512_bf16 or amx_bf16.*slower than fp32"):
        result = jaxnn.fit(L.Dense(2), (x, (x[:, 0] > 0).astype(np.int32)), precision="bf16", **QUICK)
    assert result.summary["levers"]["precision_pays"] is False
    # A CPU with the instructions, held below them by XLA_FLAGS' cap (a capped benchmark): the same warning.
    monkeypatch.setattr(_levers, "cpu_info", lambda: ("a CPU", frozenset({"avx2", "avx512_bf16"}), 2))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")  # read by the levers (too late for XLA itself)
    with pytest.warns(PrecisionWarning, match="bf16 on a CPU without avx512_bf16"):
        result = jaxnn.fit(L.Dense(2), (x, (x[:, 0] > 0).astype(np.int32)), precision="bf16", **QUICK)
    assert result.summary["levers"]["precision_pays"] is False


def test_clip_norm_sets_the_default_optimizers_clip():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32) * 100
    y = (x[:, 0] > 0).astype(np.int32)
    model = L.Dense(2)
    runs = {c: jaxnn.fit(model, (x, y), clip_norm=c, **{**QUICK, "steps": 1}) for c in (1.0, 0, None, 0.01)}
    assert runs[0].summary["levers"]["clip_norm"] is None and runs[0.01].summary["levers"]["clip_norm"] == 0.01
    # 0 and None both clip nothing; the recorded optimizer is optax's AdamW without (or with) the clip.
    same = lambda a, b: all(np.array_equal(p, q) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert same(runs[0].state.params, runs[None].state.params)
    assert not same(runs[1.0].state.params, runs[0].state.params)  # this gradient's norm is far above 1
    clipped = jaxnn.train.make_optimizer(1e-3, total_steps=1, clip_norm=0.01)
    assert "clip_by_global_norm" in jaxnn._src.optimizer_id.fingerprint(clipped, None)["transforms"]
    with pytest.raises(ConfigError, match="clip_norm must be a number >= 0"):
        jaxnn.fit(model, (x, y), clip_norm=-1, **QUICK)


def test_jaxnn_train_prints_the_block_and_keeps_it_in_summary_json(tmp_path, caplog):
    from jaxnn import cli

    run = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--size", "small", "--steps", "2", "--batch-size", "16", "--clip-norm", "0",
            "--run-dir", str(run), "--no-progress", "--no-plots", "--no-summary", "--no-compile-cache"]  # fmt: skip
    assert cli.main(argv) == 0
    block = _block(caplog)
    levers = json.loads((run / "summary.json").read_text())["levers"]
    assert len(block) == 5 and levers["clip_norm"] is None and "clip norm off" in block[4]
    assert f"{levers['trainable_params']:,} trainable, 0 frozen" in block[0]
