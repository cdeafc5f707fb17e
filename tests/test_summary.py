"""summary(): per-row parameter counts and shapes against init_model/output_shape, Dense FLOPs against 2*B*in*out,
eval-mode stateful/stochastic layers, nested and parallel models, the input dtype it picks, `Layer.children`, and
clear errors for bad input."""

import math

import jax
import pytest

from jaxnn import layers as L
from jaxnn.layers.combinators import splits_input
from jaxnn.layers.tabulate import format_bytes
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig


def _size(tree):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _init_params(model, key, in_shape):
    # init_model's params, traced abstractly: running it eagerly compiles every initialiser op (seconds).
    return jax.eval_shape(lambda k: L.init_model(model, k, in_shape)[1], key)


@pytest.mark.parametrize(
    "model, in_shape",
    [
        (CNN(CNNConfig().small()), (2, 8, 8, 1)),
        (GPT(GPTConfig().small()), (2, 32)),  # int token ids: summary must pick int32 for the Embedding
    ],
    ids=["cnn", "gpt"],
)
def test_rows_match_init_and_output_shape(model, in_shape, key):
    printed = []
    result = L.summary(model, in_shape, print_fn=printed.append)
    params = _init_params(model, key, in_shape)
    children = model.children

    assert [r.path for r in result.rows] == [f"{i}_{c.name}" for i, c in enumerate(children)]
    assert {r.path for r in result.rows if r.params} == set(params)
    assert sum(r.params for r in result.rows) == result.total_params == _size(params)
    assert result.total_bytes == 4 * result.total_params  # fp32 parameters
    for i, row in enumerate(result.rows):
        assert row.params == _size(params.get(row.path, {}))
        assert row.out_shape == L.output_shape(L.serial(*children[: i + 1]), in_shape)
    assert result.out_shape == L.output_shape(model, in_shape)
    assert result.total_flops > 0 and all(r.flops is not None for r in result.rows)

    assert len(printed) == 1 and printed[0] == str(result)
    assert all(r.path in printed[0] for r in result.rows) and "Total" in printed[0]
    assert f"{result.total_params:,}" in printed[0]


def test_dense_flops_match_matmul_count():
    batch, din, dout = 8, 64, 32
    reference = 2 * batch * din * dout + batch * dout  # multiply-adds plus the bias
    single = L.summary(L.Dense(dout), (batch, din), print_fn=None)
    assert len(single.rows) == 1 and single.rows[0].path == "dense"
    assert single.rows[0].flops == pytest.approx(reference, rel=0.1)

    mlp = L.summary(L.serial(L.Dense(dout), L.Relu, L.Dense(4)), (batch, din), print_fn=None)
    assert mlp.rows[0].flops == pytest.approx(reference, rel=0.1)
    assert mlp.total_flops == pytest.approx(reference + batch * dout + 2 * batch * dout * 4 + batch * 4, rel=0.1)


def test_stateful_dropout_nested_and_parallel(key):
    model = L.serial(
        L.Conv(4, 3),
        L.BatchNorm(),
        L.Relu,
        L.Dropout(0.5),
        L.residual(L.Dense(4), L.Dropout(0.1), name="res"),
        L.Flatten(),
        L.Dense(3),
        name="net",
    )
    in_shape = (2, 5, 5, 3)
    params = _init_params(model, key, in_shape)
    deep = L.summary(model, in_shape, depth=2, flops=False, print_fn=None)
    assert [r.path for r in deep.rows][4:6] == ["4_res.0_dense", "4_res.1_dropout"]
    assert sum(r.params for r in deep.rows) == deep.total_params == _size(params)
    assert deep.rows[-1].out_shape == deep.out_shape == (2, 3)
    assert all(r.flops is None for r in deep.rows) and "-" in str(deep)
    assert L.summary(model, in_shape, depth=0, flops=False, print_fn=None).rows[0].path == "net"

    both = L.summary(L.parallel(L.Dense(3), L.Embedding(5, 2)), ((2, 4), (2, 6)), flops=False, print_fn=None)
    assert [r.out_shape for r in both.rows] == [(2, 3), (2, 6, 2)]
    assert both.out_shape == ((2, 3), (2, 6, 2)) and both.in_dtype == "('float32', 'int32')"


def test_bf16_policy_and_explicit_dtype():
    result = L.summary(L.Dense(4), (2, 3), policy="bf16", flops=False, print_fn=None)
    assert result.in_dtype == "bfloat16" and result.policy == "bf16" and result.total_bytes == 4 * 16
    ids = L.summary(
        L.serial(L.Lambda(lambda x: x % 5), L.Embedding(5, 2)), (2, 3), in_dtype="int32", flops=False, print_fn=None
    )
    assert ids.out_shape == (2, 3, 2)


def test_input_dtype_found_without_names():
    # An Embedding under any name, behind a float-agnostic layer, or in a parallel branch under a serial: int32.
    renamed = L.summary(L.serial(L.Embedding(5, 2, name="tokens"), L.Dense(3)), (2, 4), flops=False, print_fn=None)
    assert renamed.in_dtype == "int32" and renamed.out_shape == (2, 4, 3)
    ids = L.summary(L.serial(L.Lambda(lambda x: x % 5), L.Embedding(5, 2)), (2, 3), flops=False, print_fn=None)
    assert ids.in_dtype == "int32"
    two_tower = L.serial(
        L.parallel(L.Dense(2), L.Embedding(5, 2)),
        L.Lambda(lambda xs: xs[0] + xs[1].sum(1), shape_fn=lambda shapes: shapes[0]),
        name="tt",
    )
    tt = L.summary(two_tower, ((2, 4), (2, 6)), depth=2, flops=False, print_fn=None)
    assert tt.in_dtype == "('float32', 'int32')" and tt.out_shape == (2, 2)
    assert [r.path for r in tt.rows] == ["0_parallel.0_dense", "0_parallel.1_embed", "1_lambda"]
    assert L.summary(L.Dense(3), (2, 4), flops=False, print_fn=None).in_dtype == "float32"


def test_layer_children():
    a, b = L.Dense(3), L.Relu
    assert L.Dense(3).children == () and L.Layer(a.init, a.apply, "x").children == ()
    assert L.Layer(a.init, a.apply, "x", None).init_state is None  # positional construction still works
    assert L.serial(a, b).children == (a, b) and L.parallel(a, b).children == (a, b)
    assert L.residual(a, b).children == (a, b)
    assert splits_input(L.parallel(a, b)) and not splits_input(L.serial(a, b)) and not splits_input(a)
    # residual's params are its body's "<index>_<name>" keys, unnested: the keys summary derives from children.
    params = jax.eval_shape(lambda k: L.residual(L.Dense(4), L.Relu).init(k, (2, 4))[1], jax.random.key(0))
    assert set(params) == {"0_dense"}


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


@pytest.mark.parametrize("in_shape", [(2, -1), (2, 0), (2.0, 3), (), "2,3", 4, (2, True), ((2, 3), 4)])
def test_bad_in_shape(in_shape):
    with pytest.raises(ValueError, match="in_shape"):
        L.summary(L.Dense(3), in_shape, print_fn=None)


def test_bad_model_and_depth():
    with pytest.raises(TypeError, match="model"):
        L.summary(lambda x: x, (2, 3), print_fn=None)
    with pytest.raises(ValueError, match="depth"):
        L.summary(L.Dense(3), (2, 3), depth=-1, print_fn=None)
    with pytest.raises(TypeError, match="in_dtype"):
        L.summary(L.Dense(3), (2, 3), in_dtype="not a dtype", print_fn=None)


@pytest.mark.parametrize("scan_layers", [pytest.param(False, marks=pytest.mark.slow), True])
def test_depth_opens_repeat_and_transformer_blocks_with_counts_that_add_up(scan_layers):
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=3, num_heads=2, scan_layers=scan_layers))
    shallow = L.summary(model, (2, 8), depth=1, flops=False, print_fn=None)
    deep = L.summary(model, (2, 8), depth=4, flops=True, print_fn=None)
    assert deep.total_params == shallow.total_params == _size(_init_params(model, jax.random.key(0), (2, 8)))
    assert sum(r.params for r in deep.rows) == deep.total_params
    paths = [r.path for r in deep.rows]
    assert any(".0_attn.1_attention" in p for p in paths) and any(".1_mlp.1_fc" in p for p in paths)
    repeated = [p for p in paths if p.endswith("(x3)")]
    assert bool(repeated) == scan_layers, paths
    fc = [r for r in deep.rows if ".1_mlp.1_fc" in r.path]
    # Each fc matmul: 2 * 16 tokens * 16 * 64 FLOPs; three blocks, in one scanned row or in three.
    assert sum(r.flops for r in fc) >= 3 * 2 * 16 * 16 * 64
