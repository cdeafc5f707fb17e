"""Safetensors files round-trip bit for bit and load foreign names through a map; `jaxnn export` writes a
jax.export program that a process without jaxnn runs on any batch size, with jaxnn's own outputs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxnn import cli
from jaxnn._src import pytree
from jaxnn.checkpoint import load_params
from jaxnn.export import STATE_PREFIX, load_safetensors, save_safetensors, write_export
from jaxnn.layers.core import init_model
from jaxnn.models import CNNConfig, ResNetConfig, get_model
from jaxnn.models.factory import model_from_record
from jaxnn.train import make_predict

# Small models, a few steps, one evaluation, no threads or files beyond the checkpoint.
SHORT = ["--size", "small", "--steps", "5", "--eval-every", "5", "--batch-size", "8", "--log-every", "5"]
QUICK = [*SHORT, "--backend", "inline", "--no-progress", "--no-plots", "--no-summary"]

# Runs in a fresh interpreter from an empty directory, with jaxnn made unimportable: what a consumer of the export
# has is jax, numpy and safetensors.
CONSUMER = """
import json, pathlib, sys
sys.modules["jaxnn"] = None  # any import of jaxnn now fails
import jax, numpy as np, safetensors.numpy
for d in sys.argv[1:]:
    d = pathlib.Path(d)
    exported = jax.export.deserialize((d / "model.jaxexport").read_bytes())
    weights = safetensors.numpy.load_file(d / "weights.safetensors")
    for name in ("x3", "x5"):
        np.save(d / f"{name}_out.npy", np.asarray(exported.call(weights, np.load(d / f"{name}.npy"))))
assert "jaxnn" not in sys.modules or sys.modules["jaxnn"] is None
print("consumer ok", json.dumps([str(a.shape) for a in exported.in_avals[-1:]]))
"""


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_safetensors_round_trip_is_bitwise(tmp_path):
    rng = np.random.default_rng(0)
    params = {
        "0_dense": {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4, jnp.float32)},
        "1_embed": {"table": jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16)},
        "2_odd": {"nan": jnp.array([np.nan, -0.0, np.inf], jnp.float32), "count": jnp.arange(3, dtype=jnp.int32)},
    }
    state = {"3_batch_norm": {"mean": jnp.ones(4, jnp.bfloat16), "var": jnp.full(4, 0.5, jnp.float32)}}
    config = {"model": "cnn", "model_config": {"widths": [8, 16]}, "step": 7}
    path = tmp_path / "w.safetensors"
    save_safetensors(params, path, model_state=state, config=config)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary file left behind
    assert set(safetensors.numpy.load_file(path)) == {
        *pytree.flatten(params),
        *("state." + n for n in pytree.flatten(state)),
    }

    got_params, got_state, got_config = load_safetensors(path)
    assert got_config == config
    for want, got in ((params, got_params), (state, got_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(jax.tree.leaves(jax.tree.map(same_bits, want, got)))
    assert got_params["1_embed"]["table"].dtype == jnp.bfloat16


def test_foreign_names_load_through_a_name_map(tmp_path, key):
    model = get_model("cnn", CNNConfig().small())
    _, params, state = init_model(model, key, (2, 8, 8, 1))
    # Names as another library would write them (same layouts): features.<i>.weight/bias, classifier.weight/bias.
    ours_to_theirs = {
        "0_conv.w": "features.0.weight",
        "0_conv.b": "features.0.bias",
        "3_conv.w": "features.3.weight",
        "3_conv.b": "features.3.bias",
        "7_logits.w": "classifier.weight",
        "7_logits.b": "classifier.bias",
    }
    assert set(ours_to_theirs) == set(pytree.flatten(params))
    foreign = {ours_to_theirs[n]: np.asarray(a) for n, a in pytree.flatten(params).items()}
    foreign["classifier.num_batches_tracked"] = np.zeros((), np.int64)  # an extra tensor the map drops
    path = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file(foreign, path)

    name_map: dict[str, str | None] = {v: k for k, v in ours_to_theirs.items()}
    name_map["classifier.num_batches_tracked"] = None
    loaded, loaded_state, config = load_safetensors(path, name_map=name_map)
    assert config is None and loaded_state == {}
    x = jax.random.normal(key, (4, 8, 8, 1))
    predict = make_predict(model)
    np.testing.assert_array_equal(predict(loaded, {}, x), predict(params, state, x))

    by_function, _, _ = load_safetensors(path, name_map=name_map.get)  # a callable works the same way
    assert jax.tree.structure(by_function) == jax.tree.structure(params)
    with pytest.raises(ValueError, match="does not name"):
        load_safetensors(path, name_map={k: v for k, v in name_map.items() if v != "0_conv.w"})
    with pytest.raises(ValueError, match="maps two tensors"):
        load_safetensors(path, name_map=lambda name: "0_conv.w")


def test_model_from_record_restores_tuples():
    model, mcfg = model_from_record({"model": "cnn", "model_config": {"widths": [8, 16], "num_classes": 3}})
    assert mcfg == CNNConfig(widths=(8, 16), num_classes=3)
    assert callable(model.apply)
    with pytest.raises(ValueError, match="needs 'model'"):
        model_from_record({"model": "cnn"})


def save_inputs(out, rng):
    """Inputs of two batch sizes (one symbolic-batch program serves both) as the export's export.json describes."""
    info = json.loads((out / "export.json").read_text())
    assert info["input"]["shape"][0] == "b" and info["output"]["shape"][0] == "b"
    shape, dtype = info["input"]["shape"][1:], info["input"]["dtype"]
    for n in (3, 5):
        if dtype == "int32":
            x = rng.integers(0, 256, (n, *shape)).astype(np.int32)
        else:
            x = rng.normal(size=(n, *shape)).astype(dtype)
        np.save(out / f"x{n}.npy", x)
    return info


@pytest.mark.system
def test_train_export_and_run_without_jaxnn(tmp_path, key):
    rng = np.random.default_rng(1)
    runs = {
        "cnn": ["--model", "cnn"],
        "gpt": ["--model", "gpt", "--seq-len", "16", "--layers", "1", "--precision", "bf16"],
    }
    references = {}  # export directory -> (model, policy, params, model_state) to compare with
    for name, argv in runs.items():
        run_dir, out = tmp_path / f"run-{name}", tmp_path / f"export-{name}"
        assert cli.main(["train", *argv, *QUICK, "--run-dir", str(run_dir)]) == 0
        assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(out), "--platforms", "cpu", "cuda"]) == 0
        info = save_inputs(out, rng)
        assert info["platforms"] == ["cpu", "cuda"] and info["config"]["model"] == name
        loaded = load_params(run_dir)
        model, _ = model_from_record(loaded.config)
        references[out] = (model, loaded.config["precision"], loaded.params, loaded.model_state)

    # A model with state (BatchNorm statistics, made non-trivial), through the library call rather than the CLI.
    model = get_model("resnet", ResNetConfig().small())
    _, params, state = init_model(model, key, (1, 8, 8, 1))
    state = jax.tree.map(lambda a: a + jax.random.uniform(key, a.shape), state)
    out = write_export(tmp_path / "export-resnet", model, params, state, (8, 8, 1), dtype="float32")
    assert any(n.startswith(STATE_PREFIX) for n in safetensors.numpy.load_file(out / "weights.safetensors"))
    save_inputs(out, rng)
    references[out] = (model, "fp32", params, state)

    consumer = tmp_path / "consumer"
    consumer.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", CONSUMER, *map(str, references)],
        cwd=consumer,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "consumer ok" in proc.stdout

    cpu = jax.devices("cpu")[0]  # where the consumer ran, also on a machine with an accelerator
    for out, (model, policy, params, state) in references.items():
        predict = make_predict(model, policy)
        params, state = jax.device_put((params, state), cpu)
        for n in (3, 5):
            want = np.asarray(predict(params, state, jax.device_put(np.load(out / f"x{n}.npy"), cpu)))
            got = np.load(out / f"x{n}_out.npy")
            assert got.shape[0] == n
            # Bit for bit: the same jaxnn function, compiled by the same XLA for the same shapes.
            np.testing.assert_array_equal(got, want, err_msg=f"{out.name}, batch {n}")

    # Only the weights: the same arrays the checkpoint holds, with the run config (and its step) in the header.
    weights = tmp_path / "weights-cnn"
    assert (
        cli.main(["export", "--run-dir", str(tmp_path / "run-cnn"), "--out", str(weights), "--safetensors-only"]) == 0
    )
    assert sorted(p.name for p in weights.iterdir()) == ["weights.safetensors"]
    params, _, config = load_safetensors(weights / "weights.safetensors")
    loaded = load_params(tmp_path / "run-cnn")
    assert config is not None and config["model"] == "cnn" and config["step"] == loaded.step
    assert all(jax.tree.leaves(jax.tree.map(same_bits, loaded.params, params)))


def test_export_refuses_a_missing_run_dir(tmp_path, capsys):
    assert cli.main(["export", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxnn: error: ") and "\n" not in err, err
    assert "nope" in err and not (tmp_path / "out").exists()
