"""A small Dense MLP, its tensor-parallel rules and the fit both the sharding tests and a multi-process worker run.

    python tests/sharded_mlp.py OUT_DIR

is one process of a two-process run (4 simulated CPU devices each) started the way a Kubernetes indexed Job starts
its pods: `JAXNN_COORDINATOR` and `JAXNN_NUM_PROCESSES` in every pod's environment, the process id from the
`JOB_COMPLETION_INDEX` Kubernetes sets. It trains under `fsdp=8` into OUT_DIR/fsdp and under `data=2,tensor=4`
(with `RULES`) into OUT_DIR/dxt, each run ending with a checkpoint.
"""

import pathlib
import sys

import numpy as np
import optax

import jaxnn.layers as L
from jaxnn import fit
from jaxnn.train import classification_loss

# Megatron's pair: the first layer split by output columns, the second by input rows.
RULES = {"*0_dense.w": [None, "tensor"], "*0_dense.b": ["tensor"], "*2_dense.w": ["tensor", None]}
STEPS, BATCH, FEATURES = 3, 16, 16


def mlp():
    return L.serial(L.Dense(64), L.Relu, L.Dense(10))


def optimizer():
    return optax.sgd(0.1, momentum=0.9)


def batches():
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32), "y": rng.integers(0, 10, BATCH).astype(np.int32)}
        for _ in range(STEPS)
    ]


def fit_mlp(mesh, **kwargs):
    return fit(
        mlp(),
        batches(),
        loss=classification_loss,
        optimizer=optimizer(),
        steps=STEPS,
        batch_size=BATCH,
        mesh=mesh,
        log_every=1,
        progress=False,
        plots=False,
        **kwargs,
    )


if __name__ == "__main__":
    from jaxnn.parallel import configure_cpu_devices, initialize_distributed

    configure_cpu_devices(4)
    assert initialize_distributed(heartbeat_timeout_s=10)
    out = pathlib.Path(sys.argv[1])
    fit_mlp("fsdp=8", run_dir=str(out / "fsdp"), async_checkpoints=False)
    fit_mlp("data=2,tensor=4", sharding_rules=RULES, run_dir=str(out / "dxt"), async_checkpoints=False)
