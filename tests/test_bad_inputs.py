"""Bad input to layers, models and the training step: one line that names the layer's path (or the argument) and
both shapes or dtypes, raised before anything runs; never a silently wrong result."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxnn import layers as L
from jaxnn.models import GPT, GPTConfig
from jaxnn.precision import LossScale
from jaxnn.train import classification_loss, create_train_state, make_multi_step, make_train_step


def params_of(layer, shape):
    return layer.init(jax.random.key(0), shape)[1]


def test_integer_inputs_are_refused_never_cast_into_the_weights():
    model = L.serial(L.Flatten(), L.Dense(10))
    params = params_of(model, (2, 8, 8, 1))
    images = np.random.default_rng(0).integers(0, 255, (2, 8, 8, 1), dtype=np.uint8)
    with pytest.raises(
        TypeError, match=r"^serial/1_dense: expected a floating-point input, got dtype uint8; normalise"
    ):
        model.apply(params, images)
    with pytest.raises(TypeError, match=r"^dense: expected a floating-point input, got dtype int32"):
        L.Dense(3).apply(params_of(L.Dense(3), (2, 4)), jnp.ones((2, 4), jnp.int32))
    assert model.apply(params, images.astype(np.float32) / 255).dtype == jnp.float32


def test_parameters_of_another_width_or_model_are_refused_with_their_path():
    wide, narrow = L.serial(L.Dense(8), L.Relu, L.Dense(3)), L.serial(L.Dense(4), L.Relu, L.Dense(3))
    x = jnp.ones((2, 5))
    with pytest.raises(
        ValueError, match=r"^serial/0_dense: parameter 'w' has shape \(5, 8\), this layer needs \(5, 4\)"
    ):
        narrow.apply(params_of(wide, x.shape), x)
    other = L.serial(L.Conv(4, 3), L.Flatten())
    with pytest.raises(ValueError, match=r"^serial/0_dense: params have no 'w' \(found \[\]\)"):
        narrow.apply(params_of(other, (2, 6, 6, 1)), x)


def test_sequences_longer_than_the_position_table_are_refused_at_apply():
    model = GPT(GPTConfig(seq_len=16, d_model=16, num_layers=1, num_heads=2))
    params = params_of(model, (1, 16))
    with pytest.raises(
        ValueError, match=r"^gpt/1_pos_embed: expected input of rank 3 \(batch, time <= 16, .*\(1, 20, 16\)"
    ):
        model.apply(params, jnp.zeros((1, 20), jnp.int32))


def test_embedding_ids_out_of_range():
    layer = L.Embedding(10, 4)
    params = params_of(layer, (2, 3))
    with pytest.raises(ValueError, match=r"^embed: ids must be in \[0, 10\), got values in \[0, 12\]"):
        layer.apply(params, jnp.array([[0, 12, 3]]))
    traced = jax.jit(layer.apply)(params, jnp.array([[0, 12, -1]]))  # documented: NaN rows under jit
    assert np.isnan(traced[0, 1]).all() and np.isnan(traced[0, 2]).all() and np.isfinite(traced[0, 0]).all()


@pytest.mark.parametrize(
    "layer, shape",
    [
        (L.Dense(3), (2, 4)),
        (L.Relu, (2, 4)),
        (L.Dropout(0.1), (2, 4)),
        (L.Embedding(5, 3), (2, 4)),
        (L.Flatten(), (2, 4)),
    ],
)
def test_a_misspelt_keyword_raises(layer, shape):
    x = jnp.zeros(shape, jnp.int32 if layer.name == "embed" else jnp.float32)
    with pytest.raises(TypeError, match=rf"^{layer.name}: apply got unexpected keyword\(s\) trian; it takes key,"):
        layer.apply(params_of(layer, shape), x, trian=True)


def test_loss_scale_multi_step_and_optimizer_arguments_are_checked():
    with pytest.raises(ValueError, match=r"LossScale: initial_scale must be positive and finite, got 0.0"):
        LossScale.create(0.0)
    with pytest.raises(ValueError, match=r"LossScale: period must be a positive integer .* got 0"):
        LossScale.create(period=0)
    model = L.Dense(3)
    with pytest.raises(TypeError, match=r"optimizer must be an optax.GradientTransformation .* got NoneType"):
        make_train_step(model, classification_loss, None)
    with pytest.raises(TypeError, match=r"^create_train_state: tx \(the optimizer\) must be an optax.Grad.* NoneType"):
        create_train_state(model, None, jax.random.key(0), (2, 4))
    tx = optax.sgd(0.1)
    state = create_train_state(model, tx, jax.random.key(0), (2, 4))
    multi = make_multi_step(model, classification_loss, tx, donate=False)
    empty = {"x": jnp.zeros((0, 2, 4)), "y": jnp.zeros((0, 2), jnp.int32)}
    with pytest.raises(ValueError, match=r"make_multi_step: every batch leaf needs the same leading K >= 1"):
        multi(state, empty)
