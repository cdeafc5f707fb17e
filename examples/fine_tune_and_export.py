"""Reuse a trained model: load its parameters, put a new head on it, fine-tune with part of it frozen, then export
it and run it with jax alone (no jaxnn), as a serving process would.

    python examples/fine_tune_and_export.py [--smoke] [--out DIR]
"""

import argparse
import pathlib
import tempfile

import jax
import numpy as np
import optax
import safetensors.numpy

import jaxnn
from jaxnn import layers as L
from jaxnn.checkpoint import load_params
from jaxnn.data import load_digits
from jaxnn.export import write_export
from jaxnn.finetune import freeze, load_into


def body() -> list[L.Layer]:
    return [L.Flatten(), L.Dense(64, name="hidden"), L.Relu]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check the example runs")
    parser.add_argument("--out", default=None, help="where the runs and the export go (default: a temporary folder)")
    args = parser.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="jaxnn-example-"))
    steps = 20 if args.smoke else 300
    digits = load_digits()
    x_train, x_test = ((x / digits.scale).astype(np.float32) for x in (digits.x_train, digits.x_test))
    settings = {"steps": steps, "batch_size": 32, "progress": False, "plots": False}

    # 1. Pre-train on digits 0-4 only, into a run directory (checkpoints included).
    first = digits.y_train < 5
    pre = L.serial(*body(), L.Dense(5, name="head"))
    jaxnn.fit(pre, (x_train[first], digits.y_train[first]), run_dir=str(out / "pre"), **settings)

    # 2. A new 10-way head; the body's parameters from the checkpoint, frozen; only the head trains.
    model = L.serial(*body(), L.Dense(10, name="head"))
    _, fresh, _ = L.init_model(model, jax.random.key(1), (32, 8, 8, 1))
    params, report = load_into(fresh, load_params(out / "pre").params, exclude=["*head*"])
    print(report)
    tx = freeze(optax.adam(3e-3), params, ["1_hidden.*"])
    tuned = jaxnn.fit(
        model, (x_train, digits.y_train), eval_data=(x_test, digits.y_test), params=params, optimizer=tx, **settings
    )
    print(f"fine-tuned test accuracy {tuned.summary['eval_accuracy']:.3f}")

    # 3. Export (a jax.export program with a symbolic batch size, and safetensors weights) ...
    folder = write_export(
        out / "export", model, tuned.state.params, tuned.state.model_state, (8, 8, 1), dtype="float32"
    )
    # ... and run it the way a process without jaxnn would: jax and safetensors only.
    exported = jax.export.deserialize((folder / "model.jaxexport").read_bytes())
    weights = safetensors.numpy.load_file(folder / "weights.safetensors")
    logits = exported.call(weights, x_test[:7])
    expected = model.apply(tuned.state.params, x_test[:7])
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    print(f"exported model: {np.mean(np.argmax(logits, -1) == digits.y_test[:7]):.2f} of 7 right, same as jaxnn's")


if __name__ == "__main__":
    main()
