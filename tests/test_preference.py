"""Preference tuning (jaxnn.train.preference, jaxnn.data.preference, fit's objective=): the per-example DPO loss
against numpy written here and against TRL's DPOTrainer on the same transformers model and pairs, the reference
under LoRA (the base, adapters off), a short run whose preference accuracy rises, and bad input named by file and
line."""

from __future__ import annotations

import collections
import json
import types

import jax
import numpy as np
import optax
import pytest

import jaxnn
from jaxnn.config import ConfigError
from jaxnn.data import DataError
from jaxnn.data.preference import load_preference_records
from jaxnn.layers import init_model, run
from jaxnn.lora import LoRA, add_adapters
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.train.preference import adapters_off, preference_loss, preference_model

CFG = GPTConfig(vocab_size=256, seq_len=24, d_model=32, num_layers=2, num_heads=2)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _pairs(tmp_path, n=40):
    records = [{"prompt": f"q{i % 7}:", "chosen": " yes" * (1 + i % 3), "rejected": " no!"} for i in range(n)]
    return load_preference_records(_write(tmp_path / "pairs.jsonl", records), window=CFG.seq_len)


def _numpy_sequence_logps(logits, ids, mask):
    """Summed log-softmax of the next tokens over the response, in float64: (B, 2)."""
    logits = np.asarray(logits, np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, ids[..., 1:, None], -1)[..., 0]
    return ((picked - logz) * mask).sum(-1)


def _with_reference(model, params, reference, x):
    """The DPO preference model's output with a frozen reference, which it holds as its state."""
    pm = preference_model(model, "dpo", reference=reference)
    _, _, state = init_model(pm, jax.random.key(0), x.shape)
    return jax.jit(lambda p, s, x: run(pm, p, x, state=s)[0])(params, state, x)


def test_the_frozen_reference_is_state_not_a_constant_of_the_program():
    model = GPT(GPTConfig(vocab_size=256, seq_len=24, d_model=128, num_layers=2, num_heads=2))
    _, base, _ = init_model(model, jax.random.key(0), (1, CFG.seq_len))
    pm = preference_model(model, "dpo", reference=base)
    _, _, state = init_model(pm, jax.random.key(0), (2, 2, CFG.seq_len + 1))
    assert jax.tree.leaves(state["reference"])[0] is jax.tree.leaves(base)[0]  # the same arrays, no copy made here
    program = jax.jit(lambda p, s, x: run(pm, p, x, state=s)[0]).lower(base, state, np.zeros((2, 2, 25), np.int32))
    weights = sum(np.size(leaf) for leaf in jax.tree.leaves(base))
    assert len(program.as_text()) < weights / 2  # written in, the weights would take ~8 characters each


def test_dpo_loss_matches_numpy_per_example(tmp_path):
    train, _ = _pairs(tmp_path)
    batch = {k: v[:6] for k, v in train.items()}
    model = GPT(CFG)
    _, base, _ = init_model(model, jax.random.key(0), (1, CFG.seq_len))
    policy = jax.tree.map(lambda p: p + 0.05 * np.random.default_rng(1).standard_normal(p.shape, np.float32), base)
    beta = 0.3
    logps = {}
    for name, params in (("policy", policy), ("reference", base)):
        logits = jax.jit(model.apply)(params, batch["x"][..., :-1].reshape(12, -1)).reshape(6, 2, CFG.seq_len, -1)
        logps[name] = _numpy_sequence_logps(logits, batch["x"], batch["loss_mask"])
    margin = beta * (
        (logps["policy"][:, 0] - logps["reference"][:, 0]) - (logps["policy"][:, 1] - logps["reference"][:, 1])
    )
    expected = np.log1p(np.exp(-margin))  # -log sigmoid(margin)
    loss = jax.jit(preference_loss("dpo", beta=beta))
    out = _with_reference(model, policy, base, batch["x"])
    for i in range(6):  # the loss is the batch mean: one example at a time gives the per-example loss
        got, metrics = loss(out[i : i + 1], {"loss_mask": batch["loss_mask"][i : i + 1]})
        np.testing.assert_allclose(float(got), expected[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(metrics["chosen_logps"]), logps["policy"][i, 0], rtol=1e-5)
        np.testing.assert_allclose(float(metrics["rejected_logps"]), logps["policy"][i, 1], rtol=1e-5)
    _, metrics = loss(out, batch)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.mean(), rtol=1e-5, atol=1e-6)
    assert float(metrics["preference_accuracy"]) == pytest.approx((margin > 0).mean())


def test_simpo_loss_matches_numpy(tmp_path):
    train, _ = _pairs(tmp_path)
    batch = {k: v[:5] for k, v in train.items()}
    model = GPT(CFG)
    _, params, _ = init_model(model, jax.random.key(2), (1, CFG.seq_len))
    logits = jax.jit(model.apply)(params, batch["x"][..., :-1].reshape(10, -1)).reshape(5, 2, CFG.seq_len, -1)
    seq = _numpy_sequence_logps(logits, batch["x"], batch["loss_mask"]) / batch["loss_mask"].sum(-1)
    beta, gamma = 2.0, 0.4
    expected = np.log1p(np.exp(-(beta * (seq[:, 0] - seq[:, 1]) - gamma))).mean()
    out = jax.jit(preference_model(model, "simpo").apply)(params, batch["x"])
    got, _ = preference_loss("simpo", beta=beta, gamma=gamma)(out, batch)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


def test_reference_under_lora_is_the_base_with_adapters_off(tmp_path):
    train, _ = _pairs(tmp_path)
    model = GPT(CFG)
    _, base, _ = init_model(model, jax.random.key(0), (1, CFG.seq_len))
    adapted = add_adapters(base, LoRA(rank=4), jax.random.key(1))
    adapted = jax.tree_util.tree_map_with_path(  # adapters that move the outputs: lora_b away from zero
        lambda path, p: p + 0.1 if getattr(path[-1], "key", "") == "lora_b" else p, adapted
    )
    assert jax.tree.structure(adapters_off(adapted)) == jax.tree.structure(base)
    out = jax.jit(preference_model(model, "dpo").apply)(adapted, train["x"][:3])
    frozen = _with_reference(model, adapted, base, train["x"][:3])
    np.testing.assert_allclose(np.asarray(out), np.asarray(frozen), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out[:, 0], out[:, 1])  # the policy differs from its reference


def _trl_losses(folder_policy, folder_reference, batch, beta):
    """TRL's DPO loss per example: DPOTrainer._compute_loss itself, on the transformers models with TRL's fused
    LM head, given a stand-in for the trainer's attributes (no Trainer, datasets or accelerate run)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    models = []
    for folder in (folder_policy, folder_reference):
        m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        models.append(m)
    accelerator = types.SimpleNamespace(
        device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t, unwrap_model=lambda m: m
    )
    trainer = types.SimpleNamespace(
        model=models[0], ref_model=models[1], accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics=collections.defaultdict(
            lambda: collections.defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
    )  # fmt: skip
    losses = []
    for i in range(len(batch["x"])):
        ids = torch.tensor(batch["x"][i], dtype=torch.long)  # (2, T+1): chosen, rejected
        completion = torch.zeros_like(ids)
        completion[:, 1:] = torch.tensor(batch["loss_mask"][i] > 0)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
        with torch.no_grad():
            losses.append(float(DPOTrainer._compute_loss(trainer, models[0], inputs, False)))
    assert trl.__version__
    return np.array(losses)


@pytest.mark.slow  # torch, transformers and TRL's imports alone take ~10 s
def test_dpo_loss_matches_trl(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from jaxnn.interop.hf import load_hf

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    reference = transformers.GPT2LMHeadModel(config)
    reference.save_pretrained(tmp_path / "reference")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "policy")
    train, _ = _pairs(tmp_path)
    batch = {k: v[:5] for k, v in train.items()}
    cfg, policy = load_hf(tmp_path / "policy")
    _, base = load_hf(tmp_path / "reference")
    model = GPT(cfg)
    out = _with_reference(model, policy, base, batch["x"])
    ours = np.array([
        float(preference_loss("dpo", beta=0.1)(out[i : i + 1], {"loss_mask": batch["loss_mask"][i : i + 1]})[0])
        for i in range(5)
    ])  # fmt: skip
    theirs = _trl_losses(tmp_path / "policy", tmp_path / "reference", batch, beta=0.1)
    assert np.ptp(theirs) > 1e-4  # the examples differ: the comparison is not of one constant
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["r=4,alpha=8", None])
def test_a_short_dpo_run_raises_preference_accuracy(tmp_path, lora):
    train, test = _pairs(tmp_path)
    model = GPT(CFG)
    _, params, _ = init_model(model, jax.random.key(0), (1, CFG.seq_len))
    result = jaxnn.fit(
        model, train, eval_data=test, objective="dpo", beta=0.5, lora=lora, params=params, steps=24, batch_size=8,
        log_every=4, eval_every=24, optimizer=optax.adam(3e-3), progress=False, plots=False,
    )  # fmt: skip
    accuracy = result.history["preference_accuracy"]
    assert accuracy[-1] == 1.0 and accuracy[0] < accuracy[-1]
    margins = result.history["reward_margin"]
    assert margins[-1] > margins[0] > 0
    assert result.history["eval_preference_accuracy"][-1] == 1.0
    for name in ("chosen_logps", "rejected_logps", "eval_reward_margin"):
        assert np.isfinite(result.history[name]).all()


def test_bad_preference_input_is_one_line_naming_file_and_line(tmp_path):
    good = {"prompt": "q:", "chosen": " yes", "rejected": " no"}
    same = _write(tmp_path / "same.jsonl", [good, {**good, "rejected": " yes"}, good])
    with pytest.raises(DataError, match=r"same\.jsonl:2: chosen and rejected are the same"):
        load_preference_records(same, window=16)
    long = _write(tmp_path / "long.jsonl", [good, good, {**good, "prompt": "x" * 40}])
    with pytest.raises(DataError, match=r"long\.jsonl:3: the prompt is 40 tokens"):
        load_preference_records(long, window=16)
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": "q:", "completion": " yes"}] * 3)
    with pytest.raises(DataError, match=r"plain\.jsonl:1: preference tuning needs") as err:
        load_preference_records(plain, window=16)
    assert "\n" not in str(err.value)
    model = GPT(CFG)
    with pytest.raises(ConfigError, match="trains on preference pairs"):
        jaxnn.fit(model, {"x": np.zeros((8, CFG.seq_len), np.int32), "y": np.zeros((8, CFG.seq_len), np.int32)},
                  objective="dpo", lora="r=2", steps=1, progress=False, plots=False)  # fmt: skip


def test_chat_pairs_take_the_template_and_count_the_assistant_turn_alone(tmp_path):
    from jaxnn.interop.chat import ChatTemplate

    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
        "{% endif %}"
    )
    prompt = [{"role": "user", "content": "hi?"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "hello"}],
              "rejected": [{"role": "assistant", "content": "go"}]}  # fmt: skip
    train, _ = load_preference_records(_write(tmp_path / "chat.jsonl", [record] * 3), window=40, chat_template=template)
    asked = len("<user>hi?\n<assistant>")
    for row, answer in enumerate(("hello\n", "go\n")):
        ids = train["x"][0, row]
        assert bytes(ids[: asked + len(answer)].tolist()).decode() == "<user>hi?\n<assistant>" + answer
        assert train["loss_mask"][0, row].sum() == len(answer)
        assert train["loss_mask"][0, row, asked - 1] == 1 and train["loss_mask"][0, row, asked - 2] == 0


@pytest.mark.parametrize(
    "records, flags, match",
    [
        ([{"prompt": "q:", "completion": " yes"}] * 3, ["--objective", "dpo"], ":1: preference tuning needs"),
        ([{"prompt": "q:", "chosen": " a", "rejected": " a"}] * 3, ["--objective", "dpo"], ":1: chosen and rejected"),
        ([{"prompt": "x" * 40, "chosen": " a", "rejected": " b"}] * 3, ["--objective", "simpo"], ":1: the prompt is"),
        ([{"prompt": "q:", "chosen": " a", "rejected": " b"}] * 3, ["--objective", "dpo", "--model", "cnn"], "gpt"),
    ],
)
def test_the_command_refuses_bad_pairs_in_one_line_before_writing(tmp_path, capsys, records, flags, match):
    from jaxnn import cli

    data = _write(tmp_path / "pairs.jsonl", records)
    run = tmp_path / "run"
    argv = ["train", "--model", "gpt", "--data", str(data), "--seq-len", "16", "--steps", "2", "--run-dir", str(run)]
    assert cli.main([*argv, "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxnn: error: ") and "\n" not in err and match in err, err
    assert not run.exists()
