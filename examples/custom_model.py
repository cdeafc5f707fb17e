"""Your own model, trained with jaxnn's loop: a small convolution + attention network on the bundled digits.

    python examples/custom_model.py [--smoke]

Layers are (init, apply) pairs; `serial`, `residual` and `Lambda` build a model from them; `jaxnn.fit` trains any
such model with any loss and optax optimizer, and writes metrics, plots and checkpoints to the run directory.
"""

import argparse

import numpy as np
import optax

import jaxnn
from jaxnn import layers as L
from jaxnn.data import load_digits


def model() -> L.Layer:
    return L.serial(
        L.Conv(16, 3),
        L.GroupNorm(4),
        L.Relu,
        L.MaxPool(2),  # (B, 4, 4, 16)
        L.Lambda(lambda x: x.reshape(x.shape[0], -1, x.shape[-1]), "tokens", lambda s: (s[0], s[1] * s[2], s[3])),
        L.TransformerBlock(2, causal=False, norm="rms"),  # self-attention over the 16 positions
        L.Lambda(lambda x: x.mean(axis=1), "pool", lambda s: (s[0], s[2])),
        L.Dense(10, name="logits"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check the example runs")
    parser.add_argument("--run-dir", default=None, help="write metrics, plots and checkpoints here")
    args = parser.parse_args()
    digits = load_digits()
    # Inputs must be floats: the data set's uint8 images are scaled here (a Conv refuses integers).
    x_train = (digits.x_train / digits.scale).astype(np.float32)
    x_test = (digits.x_test / digits.scale).astype(np.float32)
    steps = 20 if args.smoke else 400
    print(L.summary(model(), (32, 8, 8, 1)))
    result = jaxnn.fit(
        model(),
        (x_train, digits.y_train),
        eval_data=(x_test, digits.y_test),
        optimizer=optax.adamw(optax.cosine_decay_schedule(3e-3, steps)),
        steps=steps,
        batch_size=32,
        run_dir=args.run_dir,
        progress=not args.smoke,
    )
    print(f"test accuracy {result.summary['eval_accuracy']:.3f} after {result.summary['step']} steps")


if __name__ == "__main__":
    main()
