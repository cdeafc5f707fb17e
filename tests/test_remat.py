"""Rematerialisation policies by name: every policy gives the gradients of no remat (to 1e-6), and the ones that
keep less hold less memory in the compiled step (XLA's memory analysis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn.layers as L
from jaxnn.models import GPT, GPTConfig
from jaxnn.train import lm_loss


def _cfg(remat, scan=False, seq_len=64):
    return GPTConfig(vocab_size=64, seq_len=seq_len, d_model=32, num_layers=2, num_heads=2, remat=remat,
                     scan_layers=scan)  # fmt: skip


def _grad_fn(cfg):
    model = GPT(cfg)

    def loss(params, x):
        logits = model.apply(params, x[:, :-1])
        return lm_loss(logits, {"y": x[:, 1:]})[0]

    return model, jax.jit(jax.grad(loss))


def _data(seq_len, batch=4):
    return jnp.asarray(np.random.default_rng(0).integers(0, 64, (batch, seq_len + 1)), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_every_policy_gives_the_gradients_of_no_remat(scan):
    x = _data(64)
    model, plain = _grad_fn(_cfg(False, scan))
    _, params, _ = L.init_model(model, jax.random.key(0), (1, 64))
    want = plain(params, x)
    for policy in [True, *L.REMAT_POLICIES]:
        got = _grad_fn(_cfg(policy, scan))[1](params, x)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=str(policy))


def _temp_bytes(remat, seq_len=512):
    model, grad = _grad_fn(_cfg(remat, scan=True, seq_len=seq_len))
    params = jax.eval_shape(lambda k: L.init_model(model, k, (1, seq_len))[1], jax.random.key(0))
    x = jax.ShapeDtypeStruct((4, seq_len + 1), jnp.int32)
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_the_policies_that_keep_less_hold_less_memory():
    """With the blocks scanned (`scan_layers`): unrolled, XLA's CPU scheduler runs the recomputations early and
    the compiled step holds as much as without remat (docs/performance.md, "Rematerialisation")."""
    none, everything, nothing, dots = (_temp_bytes(p) for p in (False, "everything", "nothing", "dots_no_batch"))
    assert nothing < 0.5 * none and nothing < dots < none, (none, everything, nothing, dots)
    assert everything >= 0.9 * none


def test_a_policy_name_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="unknown policy 'sometimes'; choose one of nothing, dots"):
        L.remat(L.Dense(2), checkpoint_policy="sometimes")
    with pytest.raises(ValueError, match="unknown policy"):
        L.TransformerBlock(2, remat="sometimes")
    block = L.Repeat(L.TransformerBlock(2), 2, remat="dots")
    _, params = block.init(jax.random.key(0), (1, 4, 8))
    # Traced, not run: the policy is read where the block is traced (running it eagerly costs seconds).
    assert jax.eval_shape(block.apply, params, jnp.ones((1, 4, 8))).shape == (1, 4, 8)


@pytest.mark.slow
def test_the_remat_benchmark_measures_every_policy():
    from benchmarks.remat_memory import POLICIES, main

    rows = main(["--seq-lens", "32", "--steps", "1"])
    assert [r["policy"] for r in rows] == list(POLICIES)
    temp = {r["policy"]: r["temp_mib"] for r in rows}
    assert temp["nothing"] < temp["none"] and all(r["step_ms"] > 0 and r["h200_projected_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_fit_rematerialises_a_model_layer_by_layer_and_trains_as_without():
    import optax

    import jaxnn
    from jaxnn.config import ConfigError, FitConfig

    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = L.serial(L.Dense(16), L.Relu, L.Repeat(L.Dense(16), 2), L.Dense(2))
    rebuilt = L.rematerialised(model, "dots")
    # Each layer wrapped, the Repeat rebuilt to recompute per copy; the parameters keep their structure.
    assert [c.spec.path.rsplit(".", 1)[1] for c in rebuilt.children] == ["remat", "remat", "Repeat", "remat"]
    assert rebuilt.children[2].spec.kwargs["remat"] == "dots"
    shapes = [jax.tree.structure(L.init_model(m, jax.random.key(0), (2, 8))[1]) for m in (model, rebuilt)]
    assert shapes[0] == shapes[1]
    assert L.rematerialised(GPT(_cfg(False)), "nothing").spec.args[0].remat == "nothing"

    kwargs = {"steps": 4, "batch_size": 16, "progress": False, "optimizer": optax.adam(1e-2)}
    plain, recomputed = (jaxnn.fit(model, (x, y), **kwargs, remat=r) for r in (None, "nothing"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), plain.state.params, recomputed.state.params)
    # A run saved before `remat` existed has no such field: an unset remat leaves the record as it was.
    assert "remat" not in FitConfig().record() and FitConfig(remat="dots").record()["remat"] == "dots"
    with pytest.raises(ConfigError, match="unknown remat policy 'bogus'"):
        jaxnn.fit(model, (x, y), **kwargs, remat="bogus")
    with pytest.raises(ConfigError, match="cannot rematerialise 'dense' layer by layer.*jaxnn.layers.remat"):
        jaxnn.fit(L.Dense(2), (x, y), **kwargs, remat="dots")
