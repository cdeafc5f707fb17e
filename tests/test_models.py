"""Models: shapes, parameter counts, and the GPT's causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn.models import CONFIGS, GPT, GPTConfig, get_model

SHAPES = {"mlp": (2, 8, 8, 1), "cnn": (2, 32, 32, 3), "resnet": (2, 32, 32, 3), "gpt": (2, 32)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_small_models_produce_logits(name, key):
    model = get_model(name, CONFIGS[name]().small())
    shape = SHAPES[name]
    out_shape, params, state = L.init_model(model, key, shape)
    x = jax.random.randint(key, shape, 0, 256) if name == "gpt" else jax.random.normal(key, shape)
    y, new_state = jax.jit(lambda p, s, x: L.run(model, p, x, state=s, train=True))(params, state, x)
    assert y.shape == tuple(out_shape) == ((2, 32, 256) if name == "gpt" else (2, 10))
    assert bool(jnp.all(jnp.isfinite(y)))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_gpt_parameter_count_matches_config(key):
    cfg = GPTConfig().small()
    _, params = GPT(cfg).init(key, (1, cfg.seq_len))
    assert sum(p.size for p in jax.tree.leaves(params)) == cfg.num_params()


def test_gpt_predictions_do_not_see_future_bytes(key):
    cfg = GPTConfig().small()
    model = GPT(cfg)
    _, params = model.init(key, (1, cfg.seq_len))
    ids = jax.random.randint(key, (1, cfg.seq_len), 0, 256)
    changed = ids.at[0, 20:].set((ids[0, 20:] + 7) % 256)
    np.testing.assert_allclose(
        model.apply(params, changed)[0, :20], model.apply(params, ids)[0, :20], rtol=1e-5, atol=1e-5
    )


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        get_model("vgg")
