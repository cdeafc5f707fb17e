"""jaxnn.lr_find (jaxnn.loop.lr_range): the learning rates follow numpy's geomspace, the first loss is the starting
model's (numpy), the smoothing and the suggestion match numpy written here, the plot is written."""

import jax
import numpy as np
import pytest

import jaxnn
import jaxnn.layers as L
from jaxnn.config import ConfigError


def _data(n=256):
    x = np.random.default_rng(0).normal(size=(n, 5)).astype(np.float32)
    return x, (x[:, 0] - x[:, 1] > 0).astype(np.int32)


def test_lr_find_sweeps_the_rates_and_suggests_the_steepest_descent(tmp_path):
    x, y = _data()
    model = L.serial(L.Dense(16), L.Relu, L.Dense(2))
    start = model.init(jax.random.key(0), (1, 5))[1]
    found = jaxnn.lr_find(model, (x, y), min_lr=1e-5, max_lr=10.0, steps=40, batch_size=256, params=start,
                          plot=str(tmp_path / "lr.png"))  # fmt: skip
    n = len(found.losses)
    assert 10 <= n <= 40  # it may stop early, where the loss diverged
    np.testing.assert_allclose(found.lrs, np.geomspace(1e-5, 10.0, 40)[:n], rtol=1e-9)
    z = np.asarray(model.apply(start, x), np.float64)  # the whole set is one batch: step 1's loss is the start's
    log_p = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    assert found.losses[0] == pytest.approx(-log_p[np.arange(len(y)), y].mean(), rel=1e-5)
    average, smoothed = 0.0, []
    for i, loss in enumerate(found.losses):
        average = 0.98 * average + 0.02 * loss
        smoothed.append(average / (1 - 0.98 ** (i + 1)))
    np.testing.assert_allclose(found.smoothed, smoothed, rtol=1e-12)
    finite = np.array(smoothed)[np.isfinite(smoothed)]
    slope = np.gradient(finite, np.log(found.lrs[: len(finite)]))
    assert 1e-5 <= found.suggestion <= 10.0 and found.losses[: n // 2].min() < found.losses[0]
    if np.all(finite <= 4 * np.minimum.accumulate(finite)):  # no divergence inside the finite part
        assert found.suggestion == found.lrs[int(np.argmin(slope))]
    assert (tmp_path / "lr.png").stat().st_size > 1000 and found.plot == str(tmp_path / "lr.png")
    with pytest.raises(ConfigError, match="need 0 < min_lr < max_lr"):
        jaxnn.lr_find(model, (x, y), min_lr=1.0, max_lr=0.1)


@pytest.mark.slow
def test_jaxnn_train_lr_find_writes_the_plot_and_prints_the_suggestion(tmp_path, capsys):
    from jaxnn import cli

    run = tmp_path / "find"
    argv = ["train", "--model", "mlp", "--size", "small", "--batch-size", "32", "--lr-find", "--run-dir", str(run),
            "--no-progress", "--no-summary", "--no-compile-cache"]  # fmt: skip
    assert cli.main(argv) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("lr_find:")][0]
    suggested = float(line.split("suggested --lr ")[1].split(" ")[0])
    assert 1e-7 <= suggested <= 1.0 and (run / "lr_find.png").stat().st_size > 1000
