"""FSDP and tensor parallelism on 8 simulated devices: the sharding rules, the memory they save, the same training
as one device, and checkpoints that cross meshes."""

import importlib.util
import pathlib

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxnn import fit, parallel
from jaxnn.checkpoint import Checkpointer
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig
from jaxnn.parallel import create_sharded_state, make_mesh
from jaxnn.train import classification_loss, create_train_state, language_model_loss
from jaxnn.train.data_parallel import data_parallel_train_step

GPT_CFG = GPTConfig(seq_len=8, d_model=32, num_layers=1, num_heads=4, drop_prob=0.1)  # dropout: masks by position
MESHES = ("fsdp=8", "tensor=2,fsdp=4", "data=2,fsdp=4")


def gpt_batches(n=3, batch=16):
    tokens = np.random.default_rng(0).integers(0, 256, (n, batch, GPT_CFG.seq_len + 1)).astype(np.int32)
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in tokens]


def cnn_batches(n=3, batch=16):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(batch, 8, 8, 1)).astype(np.float32), "y": rng.integers(0, 10, batch).astype(np.int32)}
        for _ in range(n)
    ]


MODELS = {
    "gpt": (lambda: GPT(GPT_CFG), language_model_loss, gpt_batches),
    "cnn": (lambda: CNN(CNNConfig(widths=(8, 16))), classification_loss, cnn_batches),
}


def train(name, precision, mesh):
    """Three SGD-with-momentum steps (linear in the gradients, so reduction order is all that differs)."""
    build, loss, batches = MODELS[name]
    model, tx, data = build(), optax.sgd(0.1, momentum=0.9), batches()
    state = create_sharded_state(
        lambda: create_train_state(model, tx, jax.random.key(0), data[0]["x"].shape, precision), mesh
    )
    dp = data_parallel_train_step(model, loss, tx, precision, mesh=mesh)
    losses = []
    for batch in data:
        state, metrics = dp.step(state, dp.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return state, losses


def test_rules_shard_heads_hidden_width_and_large_parameters():
    mesh = parallel.make_mesh("tensor=2,fsdp=4")
    params = jax.eval_shape(
        lambda: GPT(GPTConfig(d_model=64, num_layers=1, num_heads=4)).init(jax.random.key(0), (1, 8))[1]
    )
    specs = parallel.param_specs(params, mesh)
    block = specs["2_block"]
    assert block["0_attn"]["1_attention"]["qkv"]["w"] == P("fsdp", "tensor")  # column-parallel: heads split
    assert block["0_attn"]["1_attention"]["out"]["w"] == P("tensor", "fsdp")  # row-parallel
    assert block["1_mlp"]["1_fc"]["w"] == P("fsdp", "tensor") and block["1_mlp"]["3_proj"]["w"] == P("tensor", "fsdp")
    assert block["1_mlp"]["1_fc"]["b"] == P("tensor")
    assert specs["0_embed"]["table"] == P("fsdp", None) and block["0_attn"]["0_ln"]["scale"] == P(None)
    stacked = jax.eval_shape(
        lambda: GPT(GPTConfig(d_model=64, num_layers=3, scan_layers=True)).init(jax.random.key(0), (1, 8))[1]
    )
    assert parallel.param_specs(stacked, mesh)["2_blocks"]["1_mlp"]["3_proj"]["w"] == P(None, "tensor", "fsdp")
    with pytest.raises(ValueError, match=r"axes must be among \('data', 'fsdp', 'tensor'\), got \['model'\]"):
        parallel.parse_mesh("model=2")
    with pytest.raises(ValueError, match=r"needs 16 devices, 8 available"):
        parallel.make_mesh("data=4,fsdp=4")


@pytest.mark.slow
def test_fsdp_holds_an_eighth_of_parameters_and_optimizer_state():
    model, tx = GPT(GPTConfig(seq_len=16, d_model=64, num_layers=2, num_heads=4)), optax.adam(1e-3)
    create = lambda: create_train_state(model, tx, jax.random.key(0), (8, 16))  # noqa: E731
    replicated = create_sharded_state(create, make_mesh(8))
    sharded = create_sharded_state(create, parallel.make_mesh("fsdp=8"))
    full = parallel.bytes_per_device((replicated.params, replicated.opt_state))
    per_device = parallel.bytes_per_device((sharded.params, sharded.opt_state))
    assert len(per_device) == 8 and len(set(full.values())) == 1
    assert max(per_device.values()) <= 0.15 * max(full.values()), (per_device, full)


# Every layout against one device for the GPT in fp32; each other model and precision on one layout, so that every
# layout meets both models and both precisions without compiling all twelve pairs (each costs seconds on 8 simulated
# devices).
# The fast tier runs the CNN under fsdp; `make test-all` the rest.
EQUIVALENCE = [
    pytest.param("gpt", "fp32", MESHES, marks=pytest.mark.slow),
    pytest.param("gpt", "bf16", ("tensor=2,fsdp=4",), marks=pytest.mark.slow),
    ("cnn", "fp32", ("fsdp=8",)),
    pytest.param("cnn", "bf16", ("data=2,fsdp=4",), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, precision, meshes", EQUIVALENCE)
def test_sharded_training_matches_one_device(name, precision, meshes):
    one_state, one_losses = train(name, precision, make_mesh(1))
    # bf16 rounds each reduction's partial sums where the devices split them: tolerances follow bf16's 2^-8.
    tol = {"rtol": 1e-4, "atol": 1e-5} if precision == "fp32" else {"rtol": 3e-2, "atol": 3e-3}
    for spec in meshes:
        state, losses = train(name, precision, parallel.make_mesh(spec))
        np.testing.assert_allclose(losses, one_losses, **tol, err_msg=spec)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one_state.params)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol, err_msg=spec)
    assert any(leaf.sharding.spec != P() for leaf in jax.tree.leaves(state.params))  # it was sharded


@pytest.mark.slow
def test_a_checkpoint_crosses_meshes(tmp_path):
    model, tx = GPT(GPT_CFG), optax.sgd(0.1, momentum=0.9)  # as `train` builds it
    create = lambda: create_train_state(model, tx, jax.random.key(0), (16, GPT_CFG.seq_len))  # noqa: E731
    state = create_sharded_state(create, parallel.make_mesh("fsdp=8"))
    # Values the freshly built states below do not have, so that a restore that changed nothing would show.
    state = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(state._replace(key=None))._replace(key=state.key)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(3, state, data_state={}, config={"model": "gpt"}, force=True)
    ckpt.close()
    for mesh in (parallel.make_mesh("data=2"), make_mesh(1)):
        like = create_sharded_state(create, mesh)
        ckpt = Checkpointer(tmp_path / "ckpt")
        restored, _, step = ckpt.restore(like, {"model": "gpt"})
        ckpt.close()
        assert step == 3
        for a, b, like_leaf in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(like)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding == like_leaf.sharding


@pytest.mark.slow
def test_fit_and_config_take_a_mesh_spec():
    batches = gpt_batches(1, 16)[0]
    result = fit(
        GPT(GPT_CFG),
        batches,
        loss=language_model_loss,
        steps=2,
        batch_size=8,
        mesh="tensor=2,fsdp=4",
        progress=False,
        plots=False,
    )
    qkv = result.state.params["2_block"]["0_attn"]["1_attention"]["qkv"]["w"]
    assert qkv.sharding.spec == P("fsdp", "tensor") and result.summary["step"] == 2
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by the 4 devices of the data x fsdp axis"):
        fit(
            GPT(GPT_CFG),
            batches,
            loss=language_model_loss,
            steps=2,
            batch_size=6,
            mesh="data=2,fsdp=2",
            progress=False,
            plots=False,
        )
    with pytest.raises(ValueError, match=r"form 'shard_map' is data parallelism only"):
        data_parallel_train_step(
            GPT(GPT_CFG),
            language_model_loss,
            optax.sgd(0.1),
            mesh=parallel.make_mesh("fsdp=8"),
            form="shard_map",
        )


def test_layout_benchmark_reads_collectives_from_hlo():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sharding_layouts.py"
    spec = importlib.util.spec_from_file_location("sharding_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    collectives = module.collectives

    hlo = """
  %all-gather.1 = f32[256,64]{1,0} all-gather(f32[32,64]{1,0} %p), replica_groups={}, dimensions={0}
  %ars = (f32[64]{0}, bf16[8,8]{1,0}) all-reduce-start(f32[64]{0} %a, bf16[8,8]{1,0} %b), to_apply=%add
  %ard = (f32[64]{0}, bf16[8,8]{1,0}) all-reduce-done((f32[64]{0}, bf16[8,8]{1,0}) %ars)
  %add.2 = f32[64]{0} add(f32[64]{0} %x, f32[64]{0} %y)
"""
    assert collectives(hlo) == {
        "all-gather": {"count": 1, "bytes": 256 * 64 * 4},
        "all-reduce": {"count": 1, "bytes": 64 * 4 + 64 * 2},
    }
