"""A model that is none of the built-in four (convolution, then self-attention over the 8x8 positions), trained
on the bundled digits through `jaxnn.fit`; run as a script it trains into a run directory (for kill-and-resume).

    python tests/custom_model.py RUN_DIR [--resume] [--steps N]
"""

import sys

import numpy as np

from jaxnn import layers as L

STEPS, BATCH = 300, 64


def conv_attention_model():
    return L.serial(
        L.Conv(32, 3),
        L.Relu,
        L.Conv(32, 3),
        L.Relu,
        L.MaxPool(2),
        L.Lambda(
            lambda x: x.reshape(x.shape[0], -1, x.shape[-1]),
            name="tokens",
            shape_fn=lambda s: (s[0], s[1] * s[2], s[3]),
        ),
        L.residual(L.LayerNorm(), L.MultiHeadAttention(4), name="attention"),
        L.Lambda(lambda x: x.mean(axis=1), name="pool", shape_fn=lambda s: (s[0], s[2])),
        L.Dense(10, name="logits"),
    )


def digits():
    """The bundled digits as (x, y) train and test arrays (the same split as `jaxnn.data.load_digits`)."""
    from jaxnn.data import load_digits

    d = load_digits()
    scale = lambda x: (x / d.scale).astype(np.float32)  # noqa: E731
    return (scale(d.x_train), d.y_train), (scale(d.x_test), d.y_test)


def run(run_dir, *, resume=False, **settings):
    from jaxnn import fit
    from jaxnn.train import make_optimizer

    train, test = digits()
    settings = {
        "steps": STEPS,
        "batch_size": BATCH,
        "ckpt_every": 20,
        "keep": 2,
        "log_every": 40,
        "progress": False,
        "plots": False,
        **settings,
    }
    return fit(
        conv_attention_model(),
        train,
        eval_data=test,
        run_dir=str(run_dir),
        resume=resume,
        optimizer=make_optimizer(1e-2, total_steps=settings["steps"]),
        **settings,
    )


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else STEPS
    result = run(sys.argv[1], resume="--resume" in sys.argv, steps=steps, metrics=("tensorboard",))
    print(result.summary["step"], result.summary["param_digest"])
