"""fp8 with delayed scaling (the "fp8-delayed" policy): scales from an amax history equal current scaling's when
the history holds the operands' own maxima; the train step writes the histories rather than optimising them, by
maximum over micro-batches; a run trains like current scaling's (emulated on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxnn import fp8, models, precision, train


def _operands(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (32, 64), jnp.bfloat16)
    w = (0.1 * jax.random.normal(k2, (64, 48))).astype(jnp.bfloat16)
    g = jax.random.normal(k3, (32, 48), jnp.float32)
    return x, w, g


def _amax(a):
    return jnp.max(jnp.abs(a)).astype(jnp.float32)


def test_a_history_holding_the_operands_maxima_gives_current_scalings_values_bit_for_bit():
    x, w, g = _operands()
    history = jnp.zeros((3, 4)).at[:, 1].set(jnp.stack([_amax(x), _amax(w), _amax(g)]))  # an older step's
    y_now, grads_now = jax.value_and_grad(lambda x, w: jnp.sum(fp8.matmul(x, w) * g), (0, 1))(x, w)
    delayed = jax.value_and_grad(lambda x, w, h: jnp.sum(fp8.delayed_matmul(x, w, h) * g), (0, 1, 2))
    y_then, (dx, dw, new_history) = delayed(x, w, history)
    assert y_then == y_now
    np.testing.assert_array_equal(dx, grads_now[0])
    np.testing.assert_array_equal(dw, grads_now[1])
    # The history's "gradient" is the history a step later: this step's maxima first, the oldest gone.
    np.testing.assert_array_equal(new_history[:, 0], [_amax(x), _amax(w), _amax(g)])
    np.testing.assert_array_equal(new_history[:, 1:], history[:, :-1])


def test_an_empty_history_scales_by_one_and_a_nan_still_shows():
    x, w, _ = _operands(1)
    y = fp8.delayed_matmul(x, w, jnp.zeros((3, 8)))
    q = lambda a: jnp.clip(a.astype(jnp.float32), -448, 448).astype(fp8.FORWARD_DTYPE).astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(y, q(x) @ q(w), rtol=1e-6)
    bad = x.at[0, 0].set(jnp.inf)
    assert jnp.all(jnp.isnan(fp8.delayed_matmul(bad, w, jnp.ones((3, 8)))))


def test_histories_sit_beside_the_kernels_that_run_in_fp8_only():
    params = {
        "proj": {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)},
        "blocks": {"fc": {"w": jnp.ones((4, 64, 128))}},  # a Repeat's stack of 4 kernels
        "odd": {"w": jnp.ones((64, 10))},  # 10 is no multiple of 16: stays bf16
        "conv": {"w": jnp.ones((3, 3, 16, 16))},
    }
    withh = fp8.with_histories(params, 8)
    assert withh["proj"][fp8.HISTORY_KEY].shape == (3, 8)
    assert withh["blocks"]["fc"][fp8.HISTORY_KEY].shape == (4, 3, 8)
    assert fp8.HISTORY_KEY not in withh["odd"] and fp8.HISTORY_KEY not in withh["conv"]
    assert fp8.without_histories(withh) == jax.tree.map(lambda a: a, params)
    with pytest.raises(ValueError, match="positive integer"):
        fp8.with_histories(params, 0)
    with pytest.raises(ValueError, match="needs fp8_products"):
        precision.Policy(compute_dtype=jnp.bfloat16, fp8_history=4)


TINY = models.GPTConfig(seq_len=16, d_model=32, num_layers=1, num_heads=2)  # every Dense width a multiple of 16
SMALL = models.GPTConfig(seq_len=32, d_model=64, num_layers=2, num_heads=2)


def _gpt_step(policy, accumulate=1, batch=4, cfg=TINY):
    model = models.GPT(cfg)
    tx = optax.adamw(1e-3, weight_decay=0.1, mask=train.weight_decay_mask)
    tokens = np.random.default_rng(0).integers(0, 256, (batch, cfg.seq_len + 1))
    data = {"x": jnp.asarray(tokens[:, :-1], jnp.int32), "y": jnp.asarray(tokens[:, 1:], jnp.int32)}
    state = train.create_train_state(model, tx, jax.random.key(0), data["x"].shape, policy)
    step = train.make_train_step(model, train.language_model_loss, tx, policy, accumulate=accumulate)
    return state, step, data


def _histories(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(p): np.array(v) for p, v in flat if fp8.is_history(p)}  # before donation


def test_the_train_step_writes_the_histories_and_the_optimizer_leaves_them_alone():
    state, step, data = _gpt_step("fp8-delayed")
    before = _histories(state.params)
    assert before and all(float(jnp.abs(h).sum()) == 0 for h in before.values())
    assert all(h.dtype == jnp.float32 for h in before.values())
    state, _ = step(state, data)
    first = _histories(state.params)
    state, metrics = step(state, data)
    second = _histories(state.params)
    for name in first:
        assert np.all(np.asarray(first[name][..., 0]) > 0) and np.all(np.asarray(first[name][..., 1:]) == 0), name
        np.testing.assert_array_equal(second[name][..., 1], first[name][..., 0])  # shifted, not decayed or moved
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))


@pytest.mark.slow
def test_micro_batches_combine_their_maxima_not_their_sum():
    # Two identical micro-batches (rows i and i + 2 hold the same tokens) see the same maxima as one of them.
    state, one, data = _gpt_step("fp8-delayed", batch=2)
    twice = {k: jnp.repeat(v, 2, axis=0) for k, v in data.items()}  # rows 0,0,1,1: micro-batches of rows 0,1
    _, accumulated, _ = _gpt_step("fp8-delayed", accumulate=2, batch=4)
    alone, _ = one(state, data)
    state2, _, _ = _gpt_step("fp8-delayed", batch=2)
    paired, _ = accumulated(state2, twice)
    for name, h in _histories(alone.params).items():
        np.testing.assert_allclose(_histories(paired.params)[name], h, rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_delayed_scaling_run_trains_like_current_scalings():
    losses = {}
    for policy in ("fp8", "fp8-delayed"):
        state, step, data = _gpt_step(policy, batch=8, cfg=SMALL)
        curve = []
        for _ in range(30):
            state, metrics = step(state, data)
            curve.append(float(metrics["loss"]))
        losses[policy] = curve
    assert losses["fp8-delayed"][-1] < 0.5 * losses["fp8-delayed"][0]
    assert losses["fp8-delayed"][-1] == pytest.approx(losses["fp8"][-1], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["jit", "shard_map", "pmap"])
def test_every_data_parallel_form_keeps_the_global_maxima(form):
    from jaxnn.train import data_parallel

    state, step, data = _gpt_step("fp8-delayed", batch=8)
    model = models.GPT(TINY)
    tx = optax.adamw(1e-3, weight_decay=0.1, mask=train.weight_decay_mask)
    dp = data_parallel.data_parallel_train_step(
        model, train.language_model_loss, tx, "fp8-delayed", form=form, donate=False
    )
    spread, _ = dp.step(dp.place_state(state), dp.place_batch(data))
    alone, _ = step(state, data)
    expected = _histories(alone.params)
    for name, h in _histories(dp.unreplicate(spread).params).items():
        np.testing.assert_allclose(h, expected[name], rtol=1e-5, err_msg=name)


def test_histories_are_counted_as_no_parameters():
    from jaxnn.loop._levers import parameter_counts

    model, tx = models.GPT(TINY), optax.adam(1e-3)
    plain = train.create_train_state(model, tx, jax.random.key(0), (2, 16), "fp8").params
    delayed = train.create_train_state(model, tx, jax.random.key(0), (2, 16), "fp8-delayed").params
    assert _histories(delayed) and parameter_counts(delayed, lora=False) == parameter_counts(plain, lora=False)
    assert parameter_counts(plain, lora=False)[0] == TINY.num_params()


def _fit(run_dir, steps, **kw):
    import jaxnn
    from jaxnn.train import lm_loss

    tokens = np.random.default_rng(5).integers(0, 256, (32, 17))
    data = {"x": tokens[:, :-1].astype(np.int32), "y": tokens[:, 1:].astype(np.int32)}
    return jaxnn.fit(models.GPT(TINY), data, loss=lm_loss, steps=steps, batch_size=8, precision="fp8-delayed",
                     optimizer=optax.adam(1e-2), run_dir=str(run_dir), progress=False, plots=False, **kw)  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:precision fp8-delayed on a CPU")  # the start-of-run advice, tested elsewhere
@pytest.mark.parametrize("lora", [None, "r=4,alpha=8"])
def test_a_delayed_scaling_run_resumes_bitwise_with_its_histories(tmp_path, lora):
    straight = _fit(tmp_path / "a", 4, lora=lora)
    _fit(tmp_path / "b", 2, lora=lora, ckpt_every=2)
    resumed = _fit(tmp_path / "b", 4, lora=lora, resume=True)
    histories = _histories(straight.state.params)
    # Under LoRA too (its base is frozen by a stop-gradient): every history holds four steps of maxima.
    assert histories and all(np.all(h[..., :4] > 0) and np.all(h[..., 4:] == 0) for h in histories.values())
    for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_start_of_run_advice_covers_delayed_scaling_as_fp8():
    from jaxnn.loop._levers import precision_advice

    assert "precision fp8-delayed on a CPU" in precision_advice("fp8-delayed", "cpu", frozenset({"avx512_bf16"}))
    assert "fp8-delayed with products 1024 wide" in precision_advice("fp8-delayed", "gpu", frozenset(), width=1024)
    assert precision_advice("fp8-delayed", "gpu", frozenset(), width=4096) is None
