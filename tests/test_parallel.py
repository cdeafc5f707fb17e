"""The three data-parallel forms on 8 simulated devices against one device with the same global batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import parallel
from jaxnn.layers import BatchNorm, Dense, Layer, Relu, serial
from jaxnn.train import classification_loss, create_train_state, make_optimizer, make_train_step

BATCH, FEATURES, CLASSES, STEPS = 32, 6, 4, 4
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _batches(seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32) * 2 + 0.5,
            "y": rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def _mlp():
    return serial(Dense(16), Relu, Dense(CLASSES))


def _bn_model(axis_name):
    # BatchNorm first, so its statistics are those of the raw inputs and can be checked by hand.
    return serial(BatchNorm(momentum=0.9, axis_name=axis_name), Dense(16), Relu, Dense(CLASSES))


def _tx():
    return make_optimizer(1e-2, total_steps=STEPS * 2, warmup_steps=1)


def _single_device(model, key, batches):
    tx = _tx()
    state = create_train_state(model, tx, key, (BATCH, FEATURES))
    step = make_train_step(model, classification_loss, tx, donate=False)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses


def _data_parallel(model, key, batches, form, mesh=None):
    tx = _tx()
    state = create_train_state(model, tx, key, (BATCH, FEATURES))
    dp = parallel.data_parallel_train_step(model, classification_loss, tx, mesh=mesh, form=form)
    state = dp.place_state(state)
    losses = []
    for b in batches:
        state, metrics = dp.step(state, dp.place_batch(b))
        losses.append(float(metrics["loss"]))
    return dp.unreplicate(state), losses, dp


def _assert_trees_close(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL)), a, b)


def test_eight_simulated_devices():
    assert jax.device_count() == 8
    assert parallel.make_mesh().shape[parallel.DATA_AXIS] == 8


@pytest.mark.parametrize("form", parallel.FORMS)
def test_each_form_matches_one_device(form, key):
    batches = _batches()
    ref, ref_losses = _single_device(_mlp(), key, batches)
    state, losses, dp = _data_parallel(_mlp(), key, batches, form)
    assert dp.mesh.shape[parallel.DATA_AXIS] == 8
    assert int(state.step) == STEPS
    assert not np.allclose(
        np.asarray(state.params["0_dense"]["w"]),
        np.asarray(create_train_state(_mlp(), _tx(), key, (BATCH, FEATURES)).params["0_dense"]["w"]),
    )
    _assert_trees_close(state.params, ref.params)
    _assert_trees_close(state.opt_state, ref.opt_state)
    np.testing.assert_allclose(losses, ref_losses, **TOL)


def test_jit_form_keeps_state_replicated_and_batch_sharded(key):
    tx = _tx()
    dp = parallel.data_parallel_train_step(_mlp(), classification_loss, tx)
    state = dp.place_state(create_train_state(_mlp(), tx, key, (BATCH, FEATURES)))
    batch = dp.place_batch(_batches()[0])
    # Each device holds only its own rows: the batch was never gathered whole on one device.
    assert {s.data.shape for s in batch["x"].addressable_shards} == {(BATCH // 8, FEATURES)}
    assert batch["x"].sharding.is_equivalent_to(parallel.batch_sharding(dp.mesh), 2)
    new_state, _ = dp.step(state, batch)
    w = new_state.params["0_dense"]["w"]
    assert w.sharding.is_fully_replicated and len(w.addressable_shards) == 8
    assert state.params["0_dense"]["w"].is_deleted()  # donated


def test_fewer_devices_than_available(key):
    batches = _batches()
    ref, _ = _single_device(_mlp(), key, batches)
    state, _, _ = _data_parallel(_mlp(), key, batches, "shard_map", mesh=parallel.make_mesh(4))
    _assert_trees_close(state.params, ref.params)


@pytest.mark.parametrize("form", ["shard_map", "pmap"])
def test_cross_replica_batch_norm_equals_global_batch_norm(form, key):
    batches = _batches(2)
    ref, ref_losses = _single_device(_bn_model(None), key, batches)
    state, losses, _ = _data_parallel(_bn_model(parallel.bn_axis_name(form, cross_replica=True)), key, batches, form)
    _assert_trees_close(state.params, ref.params)
    _assert_trees_close(state.model_state, ref.model_state)
    np.testing.assert_allclose(losses, ref_losses, **TOL)


def test_jit_form_batch_norm_is_global(key):
    batches = _batches(2)
    ref, _ = _single_device(_bn_model(None), key, batches)
    state, _, _ = _data_parallel(_bn_model(parallel.bn_axis_name("jit")), key, batches, "jit")
    _assert_trees_close(state.params, ref.params)
    _assert_trees_close(state.model_state, ref.model_state)


def _per_shard(model: Layer, shards: int) -> Layer:
    """One-device reference for per-device BatchNorm: the model applied to each shard of the batch separately."""

    def apply(params, x, *, state, **kwargs):
        y, new_state = jax.vmap(lambda xs: model.apply(params, xs, state=state, **kwargs))(
            x.reshape(shards, -1, *x.shape[1:])
        )
        return y.reshape(-1, *y.shape[2:]), jax.tree.map(lambda s: s.mean(0), new_state)

    return Layer(model.init, apply, "per_shard", model.init_state)


@pytest.mark.parametrize("form", ["shard_map", "pmap"])
def test_per_device_batch_norm_uses_per_shard_statistics(form, key):
    batches = _batches(3)
    state, _, _ = _data_parallel(_bn_model(parallel.bn_axis_name(form, cross_replica=False)), key, batches[:1], form)
    # After one step, running = 0.9 * init + 0.1 * (average over devices of each device's own statistics).
    shards = batches[0]["x"].reshape(8, -1, FEATURES)
    bn = state.model_state["0_batch_norm"]
    np.testing.assert_allclose(bn["mean"], 0.1 * shards.mean(axis=(0, 1)), **TOL)
    np.testing.assert_allclose(bn["var"], 0.9 + 0.1 * shards.var(axis=1).mean(axis=0), rtol=1e-4)
    assert not np.allclose(bn["var"], 0.9 + 0.1 * batches[0]["x"].var(axis=0), rtol=1e-3)

    state, _, _ = _data_parallel(_bn_model(parallel.bn_axis_name(form, cross_replica=False)), key, batches, form)
    per_shard, _ = _single_device(_per_shard(_bn_model(None), 8), key, batches)
    global_bn, _ = _single_device(_bn_model(None), key, batches)
    _assert_trees_close(state.params, per_shard.params)
    _assert_trees_close(state.model_state, per_shard.model_state)
    assert not np.allclose(state.params["1_dense"]["w"], global_bn.params["1_dense"]["w"], rtol=1e-4, atol=1e-5)


def test_jit_form_refuses_per_device_batch_norm():
    with pytest.raises(ValueError, match="form 'jit' always computes BatchNorm statistics over the global batch"):
        parallel.bn_axis_name("jit", cross_replica=False)
    with pytest.raises(ValueError, match="unknown data-parallel form 'vmap'"):
        parallel.data_parallel_train_step(_mlp(), classification_loss, _tx(), form="vmap")


@pytest.mark.parametrize("form", parallel.FORMS)
def test_batch_not_divisible_by_devices_is_refused(form, key):
    tx = _tx()
    dp = parallel.data_parallel_train_step(_mlp(), classification_loss, tx, form=form)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(12, FEATURES)).astype(np.float32), "y": rng.integers(0, CLASSES, 12)}
    with pytest.raises(ValueError, match="batch size 12 is not divisible by the 8 devices of the data axis"):
        dp.place_batch(batch)
    if form != "pmap":
        state = dp.place_state(create_train_state(_mlp(), tx, key, (12, FEATURES)))
        with pytest.raises(ValueError, match="batch size 12 is not divisible by the 8 devices"):
            dp.step(state, batch)


def test_process_slice_single_process():
    mesh = parallel.make_mesh()
    assert parallel.process_slice(32, mesh) == slice(0, 32)
    with pytest.raises(ValueError, match="batch size 30 is not divisible by the 8 devices"):
        parallel.process_slice(30, mesh)


def test_initialize_distributed_arguments(monkeypatch):
    for name in (parallel.ENV_COORDINATOR, parallel.ENV_NUM_PROCESSES, parallel.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert parallel.initialize_distributed(num_processes=1) is False
    with pytest.raises(ValueError, match="process_id missing"):
        parallel.initialize_distributed("127.0.0.1:1", num_processes=2)
    monkeypatch.setenv(parallel.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="JAXNN_NUM_PROCESSES must be an integer, got 'two'"):
        parallel.initialize_distributed()
    with pytest.raises(ValueError, match="process_id 3 is not in"):
        parallel.initialize_distributed("127.0.0.1:1", 2, 3)


def test_create_sharded_state(key):
    mesh = parallel.make_mesh()
    tx = _tx()
    state = parallel.create_sharded_state(lambda: create_train_state(_mlp(), tx, key, (BATCH, FEATURES)), mesh)
    ref = create_train_state(_mlp(), tx, key, (BATCH, FEATURES))
    assert state.params["0_dense"]["w"].sharding.is_fully_replicated
    assert len(state.params["0_dense"]["w"].addressable_shards) == 8
    _assert_trees_close(state.params, ref.params, rtol=0, atol=0)
    assert jnp.array_equal(jax.random.key_data(state.key), jax.random.key_data(ref.key))


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_shard_map_matches_jit_in_low_precision(policy, key):
    """The explicit pmean happens in float32 and the fp16 overflow check sees the global gradient."""
    batches = _batches(4)
    results = {}
    for form in ("jit", "shard_map"):
        tx = _tx()
        state = create_train_state(_mlp(), tx, key, (BATCH, FEATURES), policy)
        dp = parallel.data_parallel_train_step(_mlp(), classification_loss, tx, policy, form=form)
        state = dp.place_state(state)
        for b in batches:
            state, metrics = dp.step(state, dp.place_batch(b))
        results[form] = (state, metrics)
    (ref, ref_metrics), (state, metrics) = results["jit"], results["shard_map"]
    _assert_trees_close(state.params, ref.params, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-2)
    if policy == "fp16":
        assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == float(ref_metrics["loss_scale"])
