"""Side by side: what jaxnn's train step costs against plain `jax.jit` steps, and where the difference goes.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/ab_train_step.py [tiny|mlp] [--rounds N]`; every variant runs in
each timing window (`timing.time_interleaved`), medians; ratios are to the plain-jit Flax Linen step without
donation (the "plain jax.jit" baseline). Variants, all on the `make bench` model and batch:

- jaxnn: the default step (`make_train_step`: donated state, accuracy and gradient norm returned);
- jaxnn, typed key: the same step fed a state whose PRNG key is a typed key array instead of raw key data;
- jaxnn, loss only: `grad_norm=False` and a loss function without the accuracy (what the peers compute);
- jaxnn model, peers' step: jaxnn's layers inside the peers' own plain-jit Adam step (benchmarks/peers);
- flax linen: plain `jax.jit`, no donation; flax linen, donated: the `make bench-peers` Linen step.

Figures and what they decided: docs/performance.md, "Dispatch of the tiny step".
"""

import argparse

import jax
import jax.numpy as jnp
import optax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from benchmarks.output import print_rounds
from benchmarks.peers import peer_linen
from benchmarks.peers.jax_common import adam_step, cross_entropy, device_batch
from benchmarks.train_steps import LEARNING_RATE, jaxnn_model
from jaxnn import train
from jaxnn.layers import run
from jaxnn.profile.timing import stepper


def variants(name: str) -> dict:
    model, loss_fn = jaxnn_model(name)
    tx = optax.adam(LEARNING_RATE)
    batch = device_batch(name)
    state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape)
    states = {
        "jaxnn": state,
        "jaxnn, typed key": state._replace(key=jax.random.wrap_key_data(state.key)),
        "jaxnn, loss only": state,
    }
    states = {label: jax.tree.map(jnp.copy, s) for label, s in states.items()}  # each variant donates its own
    default_step = train.make_train_step(model, loss_fn, tx)
    steps = {
        "jaxnn": default_step,
        "jaxnn, typed key": default_step,
        "jaxnn, loss only": train.make_train_step(
            model, lambda logits, b: (loss_fn(logits, b)[0], {}), tx, grad_norm=False
        ),
    }
    fns = {label: stepper(steps[label], states[label], batch) for label in steps}

    def plain_loss(params, b):
        return loss_fn(run(model, params, b["x"], state=state.model_state)[0], b)[0]

    fns["jaxnn model, peers' step"] = adam_step(plain_loss, jax.tree.map(jnp.copy, state.params), name)

    module = peer_linen.make_module(name, jnp.float32)
    flax_params = module.init(jax.random.key(0), batch["x"])

    @jax.jit
    def flax_step(flax_state, b):
        params, opt_state = flax_state
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(module.apply(p, b["x"]), b["y"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    fns["flax linen"] = stepper(flax_step, (flax_params, tx.init(flax_params)), batch)
    fns["flax linen, donated"] = peer_linen.build(name, "fp32")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="tiny", choices=["tiny", "mlp"])
    parser.add_argument("--rounds", type=int, default=2)
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    print(f"median ms of 21 interleaved windows, ratio to flax linen; {cpu_label()}, jax {jax.__version__}")
    print_rounds(args.model, variants(args.model), "flax linen", args.rounds, warmup=20, repeats=21)


if __name__ == "__main__":
    main()
