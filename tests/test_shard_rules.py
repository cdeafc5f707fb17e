"""User sharding rules on 8 simulated devices: any model splits where its rules say and trains as on one device; the
layout report warns of an idle axis; a rule that matches nothing (unless allowed) or cannot apply fails first."""

import dataclasses
import json
import re
import shlex
import subprocess

import jax
import numpy as np
import optax
import pytest
import sharded_mlp
import smoke_commands as smoke
from jax.sharding import PartitionSpec as P
from sharded_mlp import fit_mlp, mlp

import jaxnn.layers as L
from jaxnn import cli, parallel
from jaxnn.config import ConfigError
from jaxnn.models import GPT, MLP, GPTConfig
from jaxnn.parallel import (
    BUILT_IN,
    TENSOR,
    ShardingWarning,
    as_rules,
    batch_sharding,
    create_sharded_state,
    make_mesh,
    replicated,
    shard_batch,
)
from jaxnn.train import create_train_state, language_model_loss, train_step_fn
from jaxnn.train.data_parallel import data_parallel_train_step

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
    ("*5_dense.w", [None, "tensor"]),  # the vocabulary projection, by columns
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


def test_an_idle_axis_warns_and_a_rule_that_cannot_apply_fails_before_writing(tmp_path):
    create = lambda: create_train_state(mlp(), optax.sgd(0.1), jax.random.key(0), (8, 16))  # noqa: E731
    mesh = parallel.make_mesh("tensor=8")
    # BUILT_IN matches none of this MLP's parameters: it warns of the idle axis, and its unused rules are allowed.
    with pytest.warns(
        ShardingWarning, match=r"mesh axis 'tensor' \(8 devices\) splits no parameter under jaxnn built-in"
    ):
        create_sharded_state(create, mesh)
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


UNMATCHED = re.escape(
    "sharding rule '*embed*' matches no parameter (user rules); the parameters are: 0_dense.b, 0_dense.w, "
    '2_dense.b, 2_dense.w. Fix the pattern, or allow rules that match nothing ("allow_unmatched": true'
)


def test_a_rule_that_matches_no_parameter_is_refused_before_writing_naming_it_and_the_parameters(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=UNMATCHED):
        fit_mlp("tensor=8", sharding_rules={**MLP_RULES, "*embed*": [None, "tensor"]}, run_dir=str(run_dir))
    assert not run_dir.exists()
    path = tmp_path / "rules.json"  # a JSON file's rules are named by the file
    path.write_text(json.dumps([["*0_dense.w", [None, "tensor"]], ["*1_dense.w", ["tensor", None]], ["*fc*", []]]))
    both = re.escape(f"sharding rules '*1_dense.w', '*fc*' match no parameter ({path}); the parameters are: 0_dense")
    with pytest.raises(ValueError, match=both):
        create_sharded_state(lambda: create_train_state(mlp(), optax.sgd(0.1), jax.random.key(0), (8, 16)),
                             make_mesh(1), str(path))  # fmt: skip


def test_many_parameters_are_abbreviated_in_the_refusal():
    params = {f"{i:02d}_dense": {"w": jax.ShapeDtypeStruct((4, 4), np.float32)} for i in range(20)}
    with pytest.raises(
        ValueError, match=re.escape("are: 00_dense.w, 01_dense.w, ") + r".*, 11_dense\.w, \.\.\. \(20 in all\)\."
    ):
        parallel.layout_report(params, {"tensor": 2}, as_rules({"*embed*": ["tensor"]}))


def test_rules_that_match_nothing_are_allowed_when_the_table_says_so(tmp_path):
    create = lambda: create_train_state(mlp(), optax.sgd(0.1), jax.random.key(0), (8, 16))  # noqa: E731
    mesh = parallel.make_mesh("tensor=8")
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({**MLP_RULES, "*embed*": [None, "tensor"], "allow_unmatched": True}))
    table = as_rules(str(path))
    assert table.allow_unmatched and [r.pattern for r in table.rules] == [*MLP_RULES, "*embed*"]
    pairs = dataclasses.replace(as_rules([*MLP_RULES.items(), ("*embed*", [None])]), allow_unmatched=True)
    for rules in (str(path), pairs):
        state = create_sharded_state(create, mesh, rules)
        assert state.params["0_dense"]["w"].sharding.spec == P(None, "tensor")
    assert parallel.layout_report(state.params, {"tensor": 8}, pairs).unused_rules == ("*embed*",)
    assert BUILT_IN.allow_unmatched and not as_rules(MLP_RULES).allow_unmatched


@pytest.mark.slow
def test_the_documented_command_line_rules_shard_the_built_in_mlp(tmp_path, monkeypatch, capsys):
    """docs/parallel.md's rules file and `jaxnn train` line, run as written (with a few steps): the smoke tier
    runs the same line, and the rules must match the mlp's own layer names."""
    command = "jaxnn train --model mlp --mesh tensor=8 --sharding-rules rules.json"
    doc = (smoke.ROOT / "docs" / "parallel.md").read_text()
    assert smoke.MLP_RULES_ECHO in doc.splitlines() and command in doc.splitlines()
    assert smoke.DOC_COMMANDS[command].startswith(f"{smoke.MLP_RULES_ECHO} && {command} ")
    subprocess.run(smoke.MLP_RULES_ECHO, shell=True, cwd=tmp_path, check=True)
    shapes = jax.eval_shape(lambda: MLP().init(jax.random.key(0), (1, 28, 28, 1))[1])
    report = parallel.layout_report(shapes, {"tensor": 8}, as_rules(str(tmp_path / "rules.json")))
    assert report.axes[0].split == ("1_dense.b", "1_dense.w", "3_dense.w")
    monkeypatch.chdir(tmp_path)
    argv = [*shlex.split(command)[1:], "--steps", "2", "--no-summary", "--no-progress", "--no-plots"]
    assert cli.main(argv) == 0, capsys.readouterr().err


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
