"""Checkpoints: bitwise round trip of a real TrainState, keep-last-K, fallback past a damaged newest checkpoint,
refusal of another config and the signal flag (processes killed and resumed: tests/test_loop.py)."""

import os
import pathlib
import signal
import time

import jax
import numpy as np
import optax
import pytest

from jaxnn.checkpoint import Checkpointer, CheckpointError, StopSignal, state_digest
from jaxnn.config import config_differences
from jaxnn.models import MLP, MLPConfig
from jaxnn.train import classification_loss, create_train_state, make_optimizer, make_train_step

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = {"model": "mlp", "lr": 0.001, "batch_size": 16}


def make_state(seed):
    """A state no other seed shares in any leaf: random parameters, then `seed + 1` real optimizer steps, so the
    Adam moments are non-zero and the step counts differ (a restore that returned the template's optimizer state
    or step would not pass)."""
    model = MLP(MLPConfig().small())
    tx = make_optimizer(1e-3, total_steps=10)
    state = create_train_state(model, tx, jax.random.key(seed), (4, 8, 8, 1))
    leaves, treedef = jax.tree.flatten(state.params)
    rng = np.random.default_rng(seed)
    leaves = [x + rng.normal(size=x.shape).astype(x.dtype) for x in leaves]
    state = state._replace(params=jax.tree.unflatten(treedef, leaves))
    step = make_train_step(model, classification_loss, tx, donate=False)
    for _ in range(seed + 1):
        batch = {"x": rng.normal(size=(4, 8, 8, 1)).astype(np.float32), "y": rng.integers(0, 10, 4).astype(np.int32)}
        state, _ = step(state, batch)
    return state


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(jax.random.key_data(a.key)), jax.tree.leaves(jax.random.key_data(b.key))):
        np.testing.assert_array_equal(x, y)
    flat_a = jax.tree.leaves(a._replace(key=jax.random.key_data(a.key)))
    flat_b = jax.tree.leaves(b._replace(key=jax.random.key_data(b.key)))
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def saved(tmp_path, steps=(1, 2, 3), keep=2):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=keep, save_every=1)
    states = {s: make_state(s) for s in steps}
    for s in steps:
        assert ckpt.save(s, states[s], data_state={"next_step": s}, config=CONFIG)
    ckpt.wait()
    return ckpt, states


def test_roundtrip_bitwise_and_keep_last(tmp_path):
    ckpt, states = saved(tmp_path)
    assert ckpt.all_steps() == [2, 3]
    state, data_state, step = ckpt.restore(make_state(0), CONFIG)
    assert step == 3 and data_state == {"next_step": 3}
    assert int(state.step) == 4 and any(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(state.opt_state))
    assert_same(state, states[3])
    assert not ckpt.save(3, states[3], data_state={}, config=CONFIG, force=True)  # already there
    assert not Checkpointer(tmp_path / "empty").should_save(5)
    assert Checkpointer(tmp_path / "empty").restore(make_state(0), CONFIG) is None


def newest_data_file(ckpt_dir: pathlib.Path, step: int) -> pathlib.Path:
    files = [p for p in (ckpt_dir / str(step) / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta"])
def test_damaged_newest_falls_back(tmp_path, caplog, damage):
    ckpt, states = saved(tmp_path)
    if damage == "meta":
        (tmp_path / "ckpt" / "3" / "meta" / "metadata").write_text("{not json")
    else:
        path = newest_data_file(tmp_path / "ckpt", 3)
        raw = bytearray(path.read_bytes())
        if damage == "truncate":
            raw = raw[: len(raw) // 2]
        else:
            raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    state, _, step = Checkpointer(tmp_path / "ckpt", keep=2).restore(make_state(0), CONFIG)
    assert step == 2
    assert_same(state, states[2])
    assert f"{tmp_path / 'ckpt' / '3'}" in caplog.text and "previous" in caplog.text


def test_all_damaged_is_an_error(tmp_path):
    saved(tmp_path, steps=(1,), keep=1)
    (tmp_path / "ckpt" / "1" / "meta" / "metadata").write_text("")
    with pytest.raises(CheckpointError, match="no readable checkpoint.*step 1: unreadable metadata"):
        Checkpointer(tmp_path / "ckpt").restore(make_state(0), CONFIG)


def test_incompatible_config_is_refused(tmp_path):
    saved(tmp_path, steps=(1,))
    other = {**CONFIG, "model": "cnn", "lr": 0.01}
    with pytest.raises(
        CheckpointError,
        match=r"different config: lr: checkpoint 0.001, now 0.01; "
        r"model: checkpoint 'mlp', now 'cnn'",
    ):
        Checkpointer(tmp_path / "ckpt").restore(make_state(0), other)
    # Fields named in `ignore` may differ (paths, logging cadence).
    assert Checkpointer(tmp_path / "ckpt", ignore=("lr", "model")).restore(make_state(0), other)[2] == 1
    assert config_differences({"a": 1}, {"b": 2}) == ["a: checkpoint 1, now -", "b: checkpoint -, now 2"]


def test_digest_sees_every_byte():
    a = make_state(1)
    leaves, treedef = jax.tree.flatten(a.params)
    leaves[0] = leaves[0].at[0].add(1e-6)
    assert state_digest(a) != state_digest(a._replace(params=jax.tree.unflatten(treedef, leaves)))
    assert state_digest(a) == state_digest(make_state(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_sets_flag_and_restores_handler(sig):
    before = signal.getsignal(sig)
    with StopSignal() as stop:
        assert not stop
        os.kill(os.getpid(), sig)
        time.sleep(0.01)
        assert stop and stop.received == sig
    assert signal.getsignal(sig) == before


def test_a_state_of_another_structure_is_refused_and_the_checkpoint_stays_good(tmp_path):
    ckpt, states = saved(tmp_path, steps=(1,))
    before = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    model = MLP(MLPConfig().small())
    other_optimizer = create_train_state(model, optax.sgd(0.1), jax.random.key(0), (4, 8, 8, 1))
    with pytest.raises(CheckpointError, match=r"holds a state of another structure .* opt_state\.1\.0\.mu"):
        Checkpointer(tmp_path / "ckpt").restore(other_optimizer, CONFIG)
    again = Checkpointer(tmp_path / "ckpt", save_every=1)
    assert again.restore(make_state(0), CONFIG)[2] == 1  # still good, and not marked damaged
    assert not again.save(1, states[1], data_state={}, config=CONFIG, force=True)  # so never replaced
    assert {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()} == before
