"""User sharding rules on 8 simulated devices: any model splits where its rules say and trains as on one device; the
layout report warns of an idle axis or a rule that matches nothing; a rule that cannot apply fails first."""

import json
import re

import jax
import numpy as np
import optax
import pytest
import sharded_mlp
from jax.sharding import PartitionSpec as P
from sharded_mlp import fit_mlp, mlp

import jaxnn.layers as L
from jaxnn import parallel
from jaxnn.config import ConfigError
from jaxnn.models import GPT, GPTConfig
from jaxnn.parallel import (
    BUILT_IN,
    TENSOR,
    ShardingWarning,
    as_rules,
    batch_sharding,
    create_sharded_state,
    data_parallel_train_step,
    make_mesh,
    replicated,
    shard_batch,
)
from jaxnn.train import create_train_state, language_model_loss, train_step_fn

MLP_RULES = sharded_mlp.RULES


def assert_same_params(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_fit_splits_a_dense_mlp_by_a_json_rule_file_and_matches_one_device(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(MLP_RULES))
    one = fit_mlp(make_mesh(1))
    split = fit_mlp("tensor=8", sharding_rules=str(path))
    params = split.state.params
    assert params["0_dense"]["w"].sharding.spec == P(None, "tensor") and params["2_dense"]["w"].sharding.spec == P(
        "tensor", None
    )
    momentum = split.state.opt_state[0].trace  # optimizer moments follow their parameter
    assert momentum["0_dense"]["w"].sharding.spec == P(None, "tensor")
    held, full = parallel.bytes_per_device(params), parallel.bytes_per_device(one.state.params)
    assert len(held) == 8 and max(held.values()) < 0.25 * max(full.values()), (held, full)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    losses = [[row["loss"] for row in r.history if "loss" in row] for r in (split, one)]
    assert len(losses[0]) == 3
    np.testing.assert_allclose(*losses, **tol)
    assert_same_params(params, one.state.params, tol)


D, VOCAB, T = 32, 64, 8


def user_transformer():
    """A transformer built from the catalogue, with its own names: no built-in rule knows `up`, `down` or `head`."""
    attention = L.residual(L.LayerNorm(), L.MultiHeadAttention(4, causal=True))
    mlp_block = L.residual(L.LayerNorm(), L.Dense(4 * D, name="up"), L.Gelu, L.Dense(D, name="down"))
    return L.serial(L.Embedding(VOCAB, D), L.PositionEmbedding(T), attention, mlp_block, L.LayerNorm(), L.Dense(VOCAB))


TRANSFORMER_RULES = [
    ("re:.*attention\\.qkv\\.[wb]", ["tensor"]),  # one entry: the last dimension (w's columns, b itself)
    ("*attention.out.w", ["tensor", None]),
    ("*up.w", [None, "tensor"]),
    ("*up.b", ["tensor"]),
    ("*down.w", ["tensor", None]),
    ("*4_dense.w", [None, "tensor"]),  # the vocabulary projection, by columns
]


def train_transformer(mesh, rules=None):
    model, tx = user_transformer(), optax.sgd(0.1, momentum=0.9)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 8, T + 1)).astype(np.int32)
    state = create_sharded_state(lambda: create_train_state(model, tx, jax.random.key(0), (8, T)), mesh, rules)
    dp = data_parallel_train_step(model, language_model_loss, tx, mesh=mesh)
    losses = []
    for t in tokens:
        state, metrics = dp.step(state, dp.place_batch({"x": t[:, :-1], "y": t[:, 1:]}))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.slow
def test_a_user_built_transformer_splits_over_tensor_by_its_rules_and_matches_one_device():
    one_state, one_losses = train_transformer(make_mesh(1))
    state, losses = train_transformer(parallel.make_mesh("tensor=4,fsdp=2"), TRANSFORMER_RULES)
    up = state.params["3_residual"]["1_up"]["w"]
    assert up.sharding.spec == P("fsdp", "tensor"), up.sharding.spec  # fsdp takes the dimension the rule left free
    tol = {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(losses, one_losses, **tol)
    assert_same_params(state.params, one_state.params, tol)


def test_an_idle_axis_and_an_unused_rule_warn_and_a_rule_that_cannot_apply_fails_before_writing(tmp_path):
    create = lambda: create_train_state(mlp(), optax.sgd(0.1), jax.random.key(0), (8, 16))  # noqa: E731
    mesh = parallel.make_mesh("tensor=8")
    with pytest.warns(
        ShardingWarning, match=r"mesh axis 'tensor' \(8 devices\) splits no parameter under jaxnn built-in"
    ):
        create_sharded_state(create, mesh)
    with pytest.warns(ShardingWarning, match=r"sharding rule '\*embed\*' \(user rules\) matches no parameter"):
        create_sharded_state(create, mesh, {**MLP_RULES, "*embed*": [None, "tensor"]})
    run_dir = tmp_path / "run"
    bad = re.escape(
        "sharding rule '*2_dense.w' (user rules): parameter '2_dense.w' of shape (64, 10) cannot be split over mesh "
        "axis 'tensor' (8 devices): dimension 1 has size 10"
    )
    with pytest.raises(ValueError, match=bad):
        fit_mlp("tensor=8", sharding_rules={"*2_dense.w": [None, "tensor"]}, run_dir=str(run_dir))
    assert not run_dir.exists()  # refused before the run directory was made
    with pytest.raises(ValueError, match=r"sharding rule '\*w': mesh axes must be among .*, got \['model'\]"):
        as_rules({"*w": [None, "model"]})
    with pytest.raises(
        ConfigError, match=r"configure_cpu_devices\(16\) before jax starts, or run `jaxnn train --devices 16`"
    ):
        fit_mlp(None, devices=16)
    assert BUILT_IN.match("2_blocks.1_mlp.3_proj.w") is not None and BUILT_IN.match("2_block.seq.w") is None


@pytest.mark.slow
def test_the_sharded_step_pins_the_hidden_width_and_gathers_no_whole_tensor_parallel_weight():
    model, tx = GPT(GPTConfig(seq_len=8, d_model=32, num_layers=1, num_heads=4)), optax.sgd(0.1)
    mesh = parallel.make_mesh("tensor=2,fsdp=4")
    state = create_sharded_state(lambda: create_train_state(model, tx, jax.random.key(0), (8, 8)), mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(
        train_step_fn(model, language_model_loss, tx),
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
    )
    tokens = np.zeros((8, 9), np.int32)
    with jax.set_mesh(mesh):  # as the sharded step runs (jaxnn.parallel)
        lowered = step.lower(state, shard_batch({"x": tokens[:, :-1], "y": tokens[:, 1:]}, mesh))
    # The MLP's hidden width (4 x 32) split over tensor, the batch over fsdp: the constraints reach the program.
    assert re.search(
        r'sdy.sharding_constraint .*\[\{"fsdp"\}, \{\?\}, \{"tensor"\}\]> : tensor<8x8x128xf32>', lowered.as_text()
    )
    split = {x.shape for x in jax.tree.leaves(state.params) if TENSOR in jax.tree.leaves(tuple(x.sharding.spec))}
    gathered = re.findall(r"= f32\[([\d,]+)\]\S* all-gather(?:-start)?\(", lowered.compile().as_text())
    # fsdp gathers each weight's tensor-local shard; a whole (tensor-unsplit) weight would have its full shape.
    assert gathered and split and not {tuple(map(int, g.split(","))) for g in gathered} & split, (gathered, split)
