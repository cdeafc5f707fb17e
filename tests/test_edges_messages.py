"""Bad arguments whose message once named something else: each now names the argument at fault."""

import jax
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn.errors import ConfigError
from jaxnn.generate import generate_batch
from jaxnn.train import create_train_state


def test_create_train_state_names_tx():
    with pytest.raises(TypeError, match=r"^create_train_state: tx \(the optimizer\) must be .* got NoneType$"):
        create_train_state(L.Dense(3), None, jax.random.key(0), (2, 4))


def test_generate_batch_names_key_for_a_bad_seed():
    model = L.serial(L.Embedding(16, 8), L.Dense(16))
    params = L.init_model(model, jax.random.key(0), (1, 4))[1]
    with pytest.raises(ConfigError, match=r"^generate: key \(a PRNG key or an integer seed\) must be .* got -1$"):
        generate_batch(model, params, np.ones((1, 2), np.int32), 2, key=-1, temperature=1.0, use_cache=False)


def test_predict_on_one_example_without_its_batch_axis_says_so():
    import jaxnn
    from jaxnn.data import DataError
    from jaxnn.layers import Dense, init_model, serial

    model = serial(Dense(4))
    params = init_model(model, jax.random.key(0), (1, 3))[1]
    x = np.ones((5, 3), np.float32)
    assert jaxnn.predict(model, params, x).shape == (5, 4)
    with pytest.raises(DataError, match=r"x has shape \(3,\): one example without its batch axis.*x\[None\]"):
        jaxnn.predict(model, params, x[0])


@pytest.mark.parametrize("remat", [None, "everything"])
def test_fit_names_a_model_constructor_not_yet_called(remat):
    import jaxnn

    x, y = np.ones((8, 3), np.float32), np.zeros(8, np.int32)
    with pytest.raises(TypeError, match=r"^fit: model: Dense makes a Layer but is not one; call it: Dense\(\.\.\.\)$"):
        jaxnn.fit(L.Dense, (x, y), steps=1, batch_size=4, remat=remat, progress=False)


def test_too_few_classes_in_model_config_names_the_flag(tmp_path, capsys):
    from jaxnn.cli.main import main

    argv = ["train", "--model", "mlp", "--model-config", "num_classes=5", "--steps", "1", "--no-progress",
            "--no-summary", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 2
    assert "--model-config num_classes=5: the data set digits has 10 classes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
