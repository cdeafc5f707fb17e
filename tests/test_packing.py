"""Packing: documents packed into windows with segment ids and per-document positions give, per document, the
logits and loss of the document run alone (every attention implementation, learned and rotary positions), the
loss counts exactly the real targets, and `jaxnn train --pack` reports the packing efficiency."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn
from jaxnn.data.datasets import DataError
from jaxnn.data.packing import KEYS, pack_documents, padding_efficiency
from jaxnn.models import GPT, GPTConfig
from jaxnn.train import lm_loss


def _documents(seed=0, lengths=(5, 17, 9, 2, 30, 12, 3)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, n).astype(np.int32) for n in lengths]


def test_every_target_is_packed_once_with_its_own_positions_and_segment():
    docs = _documents()
    packed = pack_documents(docs, 16)
    a = packed.arrays
    assert a["x"].shape[1] == 16 and set(a) == {"x", "y", "segment_ids", "positions", "loss_mask"}
    real = a["loss_mask"] > 0
    assert real.sum() == sum(len(d) - 1 for d in docs)
    assert packed.efficiency == pytest.approx(real.sum() / a["x"].size)
    assert packed.efficiency > padding_efficiency(docs, 16)
    pairs = sorted(zip(a["x"][real].tolist(), a["y"][real].tolist()))
    want = sorted((int(d[i]), int(d[i + 1])) for d in docs for i in range(len(d) - 1))
    assert pairs == want
    for row in range(len(a["x"])):
        for s in set(a["segment_ids"][row][real[row]].tolist()):
            pos = a["positions"][row][a["segment_ids"][row] == s]
            assert pos.tolist() == list(range(len(pos)))
    assert (a["segment_ids"][~real] == 0).all()


def _gpt(position, implementation):
    cfg = GPTConfig(vocab_size=50, seq_len=16, d_model=16, num_layers=2, num_heads=2, position=position,
                    attention_implementation=implementation)  # fmt: skip
    return GPT(cfg)


@pytest.mark.parametrize(
    ("position", "implementation"),
    [
        ("rope", "f32acc"),
        pytest.param("rope", "xla", marks=pytest.mark.slow),
        pytest.param("learned", "xla", marks=pytest.mark.slow),
        pytest.param("learned", "f32acc", marks=pytest.mark.slow),
        pytest.param("learned", "blocked", marks=pytest.mark.slow),
    ],
)
def test_a_packed_document_gives_the_logits_and_loss_it_gives_alone(position, implementation):
    docs = _documents(1)
    packed = pack_documents(docs, 16).arrays
    model = _gpt(position, implementation)
    _, params, _ = jaxnn.layers.init_model(model, jax.random.key(0), (1, 16))
    side = {k: jnp.asarray(packed[k]) for k in ("segment_ids", "positions")}
    logits = jax.jit(model.apply)(params, jnp.asarray(packed["x"]), **side)
    one = jax.jit(model.apply)  # a document alone, right-padded to the window: causal, so the padding is unseen
    for doc in docs:
        if len(doc) < 2 or len(doc) > 17:
            continue
        alone = one(params, jnp.asarray(np.pad(doc[:-1], (0, 17 - len(doc)))[None]))[0, : len(doc) - 1]
        row, start = _find(packed, doc)
        got = logits[row, start : start + len(doc) - 1]
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5)
    loss, metrics = lm_loss(logits, {k: jnp.asarray(v) for k, v in packed.items()})
    assert float(metrics["count"]) == sum(len(d) - 1 for d in docs)
    assert np.isfinite(float(loss))


def _find(packed, doc):
    """The window and offset where a whole document (shorter than a window) was packed."""
    x = packed["x"]
    for row in range(len(x)):
        for start in np.flatnonzero(packed["positions"][row] == 0):
            n = len(doc) - 1
            if np.array_equal(x[row, start : start + n], doc[:-1]) and np.array_equal(
                packed["y"][row, start : start + n], doc[1:]
            ):
                return row, start
    raise AssertionError("document not found")


def test_bad_documents_are_refused_in_one_line():
    with pytest.raises(DataError, match="document 1 must be a 1-D array of token ids"):
        pack_documents([np.arange(4), np.ones((2, 2), np.int32)], 8)
    with pytest.raises(DataError, match="no document has two tokens"):
        pack_documents([np.arange(1)], 8)
    with pytest.raises(DataError, match="seq_len must be a positive integer"):
        pack_documents([np.arange(4)], 0)


def test_the_records_and_the_bundled_text_are_documents_to_pack(tmp_path):
    from jaxnn.data import load_dataset
    from jaxnn.data.packing import documents_of, pack_corpus
    from jaxnn.data.records import load_text_records

    lines = [{"text": "a" * n} for n in (3, 30, 7, 12, 50, 4, 9, 20, 5, 6)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    corpus = load_text_records(tmp_path / "r.jsonl")
    docs, weights = documents_of(corpus.train, corpus.train_starts, corpus.train_targets)
    assert [len(d) for d in docs] == [len(r["text"]) + 1 for r in lines[:9]]  # each record and its end token
    train, test = pack_corpus(corpus, 16)
    assert train.documents == 9 and test.documents == 1
    assert train.arrays["loss_mask"].sum() == sum(len(d) - 1 for d in docs)
    text = load_dataset("text")
    docs, _ = documents_of(text.train, text.train_starts, None)
    assert sum(len(d) for d in docs) == len(text.train) and len(docs) == len(text.train_starts)


@pytest.mark.slow
def test_jaxnn_train_packs_records_and_reports_the_efficiency(tmp_path, capsys):
    from jaxnn import cli

    records = [{"prompt": f"q{i}", "completion": " answer " * (i % 7 + 1)} for i in range(60)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    argv = ["train", "--model", "gpt", "--data", str(tmp_path / "r.jsonl"), "--size", "small", "--steps", "4",
            "--batch-size", "4", "--seq-len", "64", "--no-progress", "--no-summary",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert cli.main([*argv, "--pack"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["packing_efficiency"] > summary["unpacked_efficiency"] and summary["packing_efficiency"] > 0.9
    assert json.loads((tmp_path / "run" / "config.json").read_text())["pack"] is True
    capsys.readouterr()
    assert cli.main(["train", "--model", "cnn", "--pack", "--steps", "2", "--run-dir", str(tmp_path / "c")]) == 2
    assert "packing is for text (--model gpt), not 'cnn'" in capsys.readouterr().err


def test_the_gpu_checks_packed_batch_fills_its_windows_with_whole_documents():
    from benchmarks.train_steps import DRY_RUN_GPT, packed_gpt_batch

    batch, real = packed_gpt_batch(DRY_RUN_GPT)
    shape = (DRY_RUN_GPT["batch"], DRY_RUN_GPT["seq_len"])
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(KEYS, shape)
    segments, positions = np.asarray(batch["segment_ids"]), np.asarray(batch["positions"])
    assert real == np.mean(segments != 0) > 0.5 and segments.max() >= 2  # several documents a window
    for row, pos in zip(segments, positions):
        for s in range(1, row.max() + 1):  # positions count from 0 within each document
            assert np.array_equal(pos[row == s], np.arange((row == s).sum()))
