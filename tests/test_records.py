"""JSON Lines fine-tuning data (jaxnn.data.records): prompts never count in the loss, completions and their end
token do; evaluation is the exact mean over the counted tokens; bad records are one line naming file and line."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnn
from jaxnn.data import DataError, eval_batches
from jaxnn.data.preprocess import text_batch
from jaxnn.data.records import load_text_records
from jaxnn.models.gpt import GPT, GPTConfig
from jaxnn.train import lm_loss

RECORDS = [{"prompt": f"Q{i}: what is {i}+{i}?", "completion": f" {2 * i}"} for i in range(12)] + [
    {"text": "a plain document, all of it a target"}
]


def _write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_prompts_weigh_nothing_and_completions_with_their_end_weigh_one(tmp_path):
    corpus = load_text_records(_write(tmp_path / "qa.jsonl", RECORDS), test_fraction=0.25)
    first = RECORDS[0]
    n_prompt, n_answer = len(first["prompt"].encode()), len(first["completion"].encode()) + 1  # + the newline
    assert corpus.train_targets[:n_prompt].sum() == 0 and corpus.train_targets[n_prompt : n_prompt + n_answer].all()
    assert bytes(corpus.train[n_prompt : n_prompt + n_answer].astype(np.uint8)) == b" 0\n"
    assert len(corpus.test_targets) == len(corpus.test) and corpus.vocab_size == 256
    last = RECORDS[-1]["text"].encode() + b"\n"
    assert bytes(corpus.test[-len(last) :].astype(np.uint8)) == last and corpus.test_targets[-len(last) :].all()


def test_the_masked_loss_ignores_prompt_tokens_and_counts_the_targets():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 11)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], jnp.float32)
    loss, metrics = lm_loss(logits, {"y": y, "loss_mask": mask})
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    assert np.isclose(loss, per_token[mask > 0].mean(), rtol=1e-6) and metrics["count"] == 5
    changed = logits.at[:, 0].add(100.0)  # a prompt position: never a target
    assert lm_loss(changed, {"y": y, "loss_mask": mask})[0] == loss


@pytest.mark.slow
def test_fit_on_records_trains_the_completions_and_evaluates_exactly(tmp_path):
    corpus = load_text_records(_write(tmp_path / "qa.jsonl", RECORDS), test_fraction=0.25)
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_layers=1, num_heads=2))
    result = jaxnn.fit(model, corpus, loss=lm_loss, steps=3, batch_size=4, eval_data=corpus, progress=False,
                       pipeline=jaxnn.data.PipelineConfig(batch_size=4, seq_len=16))  # fmt: skip
    batches = eval_batches(corpus, 4, seq_len=16)
    assert all("loss_mask" in b for b in batches)
    total = count = 0.0
    for b in batches:
        loss, metrics = lm_loss(model.apply(result.state.params, jnp.asarray(b["x"])), b)
        total, count = total + float(loss) * float(metrics["count"]), count + float(metrics["count"])
    assert np.isclose(result.summary["eval_loss"], total / count, rtol=1e-5)


def test_a_short_weighted_split_is_padded_with_tokens_that_never_count():
    batch = text_batch(np.arange(1, 5, dtype=np.int32), np.random.default_rng(0), 2, 8, np.ones(4, np.float32))
    assert batch["x"].shape == (2, 8) and batch["loss_mask"].sum() == 2 * 3


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad\.jsonl:2: not a JSON object"),
        ('{"question": "x"}', r"bad\.jsonl:2: expected \{\"text\": str\}, .*got \['question'\]"),
        ('{"messages": []}', r"bad\.jsonl:2: messages must be a non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"bad\.jsonl:2: messages\[0\] must have a role"),
        ('{"messages": [{"role": "user", "content": "x"}]}', r"bad\.jsonl:2: a conversation with no assistant"),
        ('["a list"]', r"bad\.jsonl:2: expected .* got list"),
        ('{"prompt": "p"}', r"bad\.jsonl:2: expected"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        load_text_records(path)


def test_too_few_records_or_no_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="1 record"):
        load_text_records(_write(tmp_path / "one.jsonl", RECORDS[:1]))
    with pytest.raises(DataError, match="no such file"):
        load_text_records(tmp_path / "missing.jsonl")
