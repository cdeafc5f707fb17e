"""Data parallelism, FSDP and tensor parallelism on 8 simulated CPU devices: the same GPT, the same steps, and how
much of the training state each device holds.

    python examples/sharded_training.py [--smoke]

On a machine with 8 accelerators, drop `configure_cpu_devices`; on many machines, start each process with
`jaxnn.parallel.initialize_distributed()` first (docs/parallel.md).
"""

import argparse

from jaxnn.parallel import configure_cpu_devices

configure_cpu_devices(8)  # before anything touches jax's devices

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxnn  # noqa: E402
from jaxnn import parallel  # noqa: E402
from jaxnn.models import GPT, GPTConfig  # noqa: E402
from jaxnn.train import language_model_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    args = parser.parse_args()
    cfg = GPTConfig(seq_len=32, d_model=32 if args.smoke else 256, num_layers=1 if args.smoke else 4, num_heads=4)
    tokens = np.random.default_rng(0).integers(0, 256, (256, cfg.seq_len + 1)).astype(np.int32)
    data = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    meshes = ("data=8", "fsdp=8", "tensor=2,fsdp=4", "data=2,fsdp=4")
    # The smoke run (make test-all) proves the script on two layouts; tests/test_sharding.py checks every layout
    # against one device.
    for mesh in meshes[::2] if args.smoke else meshes:
        result = jaxnn.fit(
            GPT(cfg),
            data,
            loss=language_model_loss,
            optimizer=optax.adam(1e-3),
            steps=3 if args.smoke else 20,
            batch_size=16,
            mesh=mesh,
            progress=False,
            plots=False,
            seed=0,
            log_every=1,
        )
        state = result.state
        held = parallel.bytes_per_device((state.params, state.opt_state))
        losses = [row["loss"] for row in result.history if row["split"] == "train"]
        print(f"{mesh:<16} state per device {max(held.values()) / 2**20:6.2f} MiB   losses {np.round(losses, 4)}")


if __name__ == "__main__":
    main()
