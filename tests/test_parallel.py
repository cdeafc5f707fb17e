"""The three data-parallel forms on 8 simulated devices against one device with the same global batches."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxnn import parallel
from jaxnn.layers import BatchNorm, Dense, Dropout, Layer, Relu, serial
from jaxnn.train import classification_loss, create_train_state, data_parallel, make_optimizer, make_train_step

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
    dp = data_parallel.data_parallel_train_step(model, classification_loss, tx, mesh=mesh, form=form)
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


@pytest.mark.parametrize("form", data_parallel.FORMS)
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
    dp = data_parallel.data_parallel_train_step(_mlp(), classification_loss, tx)
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
    state, losses, _ = _data_parallel(
        _bn_model(data_parallel.bn_axis_name(form, cross_replica=True)), key, batches, form
    )
    _assert_trees_close(state.params, ref.params)
    _assert_trees_close(state.model_state, ref.model_state)
    np.testing.assert_allclose(losses, ref_losses, **TOL)


def test_jit_form_batch_norm_is_global(key):
    batches = _batches(2)
    ref, _ = _single_device(_bn_model(None), key, batches)
    state, _, _ = _data_parallel(_bn_model(data_parallel.bn_axis_name("jit")), key, batches, "jit")
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
    state, _, _ = _data_parallel(
        _bn_model(data_parallel.bn_axis_name(form, cross_replica=False)), key, batches[:1], form
    )
    # After one step, running = 0.9 * init + 0.1 * (average over devices of each device's own statistics).
    shards = batches[0]["x"].reshape(8, -1, FEATURES)
    bn = state.model_state["0_batch_norm"]
    np.testing.assert_allclose(bn["mean"], 0.1 * shards.mean(axis=(0, 1)), **TOL)
    np.testing.assert_allclose(bn["var"], 0.9 + 0.1 * shards.var(axis=1).mean(axis=0), rtol=1e-4)
    assert not np.allclose(bn["var"], 0.9 + 0.1 * batches[0]["x"].var(axis=0), rtol=1e-3)

    state, _, _ = _data_parallel(_bn_model(data_parallel.bn_axis_name(form, cross_replica=False)), key, batches, form)
    per_shard, _ = _single_device(_per_shard(_bn_model(None), 8), key, batches)
    global_bn, _ = _single_device(_bn_model(None), key, batches)
    _assert_trees_close(state.params, per_shard.params)
    _assert_trees_close(state.model_state, per_shard.model_state)
    assert not np.allclose(state.params["1_dense"]["w"], global_bn.params["1_dense"]["w"], rtol=1e-4, atol=1e-5)


def test_jit_form_refuses_per_device_batch_norm():
    with pytest.raises(ValueError, match="form 'jit' always computes BatchNorm statistics over the global batch"):
        data_parallel.bn_axis_name("jit", cross_replica=False)
    with pytest.raises(ValueError, match="unknown data-parallel form 'vmap'"):
        data_parallel.data_parallel_train_step(_mlp(), classification_loss, _tx(), form="vmap")


@pytest.mark.parametrize("form", data_parallel.FORMS)
def test_batch_not_divisible_by_devices_is_refused(form, key):
    tx = _tx()
    dp = data_parallel.data_parallel_train_step(_mlp(), classification_loss, tx, form=form)
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
        dp = data_parallel.data_parallel_train_step(_mlp(), classification_loss, tx, policy, form=form)
        state = dp.place_state(state)
        for b in batches:
            state, metrics = dp.step(state, dp.place_batch(b))
        results[form] = (state, metrics)
    (ref, ref_metrics), (state, metrics) = results["jit"], results["shard_map"]
    _assert_trees_close(state.params, ref.params, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-2)
    if policy == "fp16":
        assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == float(ref_metrics["loss_scale"])


# ------------------------------------------------------------------------- randomness and reduction per device


def _dropout_probe(rows: int, features: int) -> Layer:
    """Dropout(0.5) on an all-ones input, then `out[i] = sum_f dropped[i, f] * w[i, f]` with one weight per
    (row, feature) of a device's shard: d out[i] / d w[i, f] is the dropped value, 0 or 2, so the gradient of w
    is the device's dropout mask (scaled), and the data-parallel gradient is the sum of every device's mask."""

    def init(key, in_shape):
        return (in_shape[0],), {"w": jnp.zeros((rows, features))}

    def apply(params, x, **_):
        return jnp.sum(x * params["w"], axis=-1)

    return serial(Dropout(0.5), Layer(init, apply, "probe"))


def _mean_output_loss(out, batch):
    return jnp.mean(out), {}


@pytest.mark.parametrize("form", ["shard_map", "pmap"])
def test_each_device_draws_its_own_dropout_mask(form, key):
    # Every device gets the same rows (all ones), so only the key can make their masks differ: with one key for
    # all devices (no fold_in of the device index) every device drops the same elements, and the data-parallel
    # gradient is n copies of one mask: dropout's noise no longer averages out over the devices.
    n, rows, features = 4, 4, 16
    model, tx = _dropout_probe(rows, features), optax.sgd(1.0)
    state = create_train_state(model, tx, key, (rows, features))
    dp = data_parallel.data_parallel_train_step(
        model, _mean_output_loss, tx, mesh=parallel.make_mesh(n), form=form, donate=False
    )
    batch = {"x": np.ones((n * rows, features), np.float32), "y": np.zeros(n * rows, np.int32)}
    new_state, _ = dp.step(dp.place_state(state), dp.place_batch(batch))
    new_state = dp.unreplicate(new_state)
    # SGD(1) from w = 0: new w = -grad = -sum over devices of 2 * mask / (rows * n) (each device's share of the
    # global mean loss), so kept[i, f] = how many of the n devices kept element (i, f): exact small integers.
    kept = -np.asarray(new_state.params["1_probe"]["w"]) * rows * n / 2
    np.testing.assert_array_equal(kept, np.round(kept))
    assert kept.min() >= 0 and kept.max() <= n and 0.3 < kept.mean() / n < 0.7, kept
    # Independent masks agree on an element (all kept or all dropped) with probability 2 / 2^n = 1/8; one mask
    # for all devices agrees everywhere.
    agree = np.mean((kept == 0) | (kept == n))
    assert agree < 0.4, f"devices drew the same dropout mask ({agree:.0%} of elements agree on every device)"
    np.testing.assert_array_equal(jax.random.key_data(new_state.key), jax.random.key_data(state.key))


_ALL_REDUCE = re.compile(r'"stablehlo\.all_reduce"\(.*?\}\) : \(([^)]*)\) ->', re.DOTALL)


def test_shard_map_sums_half_precision_gradients_in_float32(key):
    """bf16 gradients are summed over devices in float32 (rounded to bf16 once, after the sum).

    Checked in the lowered program: XLA's CPU backend promotes a bf16 all-reduce to f32 by itself
    ("..._promoted" reductions in the compiled HLO), so on the simulated CPU devices a bf16 psum gives the same
    numbers and only the program shows the difference. The numeric check below is for backends that do reduce
    in bf16 (NCCL rounds every partial sum to bf16); on this CPU it passes either way, but a bf16 reduction
    written out step by step (all_gather, then bf16 adds) fails it on every feature.
    """
    n = 8
    mesh = parallel.make_mesh(n)
    model, tx = _mlp(), optax.sgd(1.0)
    state = create_train_state(model, tx, key, (BATCH, FEATURES), "bf16")
    body = jax.shard_map(
        data_parallel.per_device_step_fn(model, classification_loss, tx, "bf16"),
        mesh=mesh,
        in_specs=(P(), P(parallel.DATA_AXIS)),
        out_specs=(P(), P()),
        check_vma=False,
    )
    text = jax.jit(body).lower(state, _batches()[0]).as_text()
    reduced = [t.strip() for m in _ALL_REDUCE.finditer(text) for t in m.group(1).split(",")]
    param_shapes = {"x".join(map(str, p.shape)) for p in jax.tree.leaves(state.params)}
    assert {t for t in reduced if t[len("tensor<") :].rsplit("x", 1)[0] in param_shapes} == {
        f"tensor<{s}xf32>" for s in param_shapes
    }, reduced
    assert all(t.endswith("xf32>") or t == "tensor<f32>" for t in reduced), reduced

    # Numerically: per-device gradients whose sum in bf16 loses most of it. Device d's gradient of w[f] is
    # x_d[f] / n (one row per device, loss = mean of the output), x_d[f] = 1 at f = d, -1 at f = d - 3 (mod n),
    # 2^-9 elsewhere. In f32 the sum is exactly 6 * 2^-9 per feature (exact in bf16 too, so the one rounding
    # after the sum changes nothing: tolerance 0). Summed in bf16, every 2^-9 term added to a running +-1 rounds
    # away (bf16 keeps 8 significant bits: 1 + 2^-9 == 1), so a feature comes out as a smaller multiple of 2^-9:
    # off by at least a sixth.
    probe = Layer(
        lambda key, shape: ((shape[0],), {"w": jnp.zeros((n,))}),
        lambda params, x, **_: jnp.sum(x * params["w"].reshape(1, -1), axis=-1),
        "probe",
    )
    x = np.full((n, n), 2.0**-9, np.float32)
    x[np.arange(n), np.arange(n)] = 1.0
    x[(np.arange(n) + 3) % n, np.arange(n)] = -1.0
    probe_state = create_train_state(probe, tx, key, (1, n), "bf16")
    dp = data_parallel.data_parallel_train_step(probe, _mean_output_loss, tx, "bf16", mesh=mesh, form="shard_map")
    new_state, _ = dp.step(dp.place_state(probe_state), dp.place_batch({"x": x, "y": np.zeros(n, np.int32)}))
    np.testing.assert_array_equal(-np.asarray(new_state.params["w"]), x.sum(0) / n)


def test_the_moved_step_names_resolve_from_jaxnn_parallel_with_a_warning_naming_their_new_home():
    import jaxnn.train.data_parallel as home

    for name in ("DataParallelStep", "FORMS", "bn_axis_name", "data_parallel_train_step", "per_device_step_fn"):
        with pytest.warns(
            DeprecationWarning,
            match=rf"jaxnn\.parallel\.{name} is deprecated .* use jaxnn\.train\.data_parallel\.{name}$",
        ):
            assert getattr(parallel, name) is getattr(home, name)
        assert name not in dir(parallel) and name not in parallel.__all__
    with pytest.warns(DeprecationWarning, match=r"use jaxnn\.train\.data_parallel$"):
        assert parallel.forms is home
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        parallel.nothing  # noqa: B018
