"""Side by side: one jitted jaxnn train step fed a state whose PRNG key is a typed key array or raw key data.

Run: `.venv/bin/python benchmarks/ab_prng_key.py`; three rounds of interleaved windows, medians.
Why TrainState holds raw key data: docs/performance.md, "Tiny-step dispatch: the PRNG key as raw key data".
"""
import jax
import jax.numpy as jnp
import optax

from jaxnn import layers as L, train
from jaxnn.bench import time_interleaved

B, D, H, C = 32, 16, 32, 10
batch = {"x": jax.random.normal(jax.random.key(1), (B, D)), "y": jax.random.randint(jax.random.key(2), (B,), 0, C)}
tx = optax.adam(1e-3)
model = L.serial(L.Dense(H), L.Relu, L.Dense(C))
raw = train.create_train_state(model, tx, jax.random.key(0), (B, D))
step = train.make_train_step(model, train.classification_loss, tx)
states = {"raw": jax.tree.map(jnp.copy, raw),
          "typed": jax.tree.map(jnp.copy, raw._replace(key=jax.random.wrap_key_data(raw.key)))}


def runner(name):
    def run():
        states[name], _ = step(states[name], batch)
        return states[name]
    return run


for _ in range(3):
    timings = time_interleaved({name: runner(name) for name in states}, warmup=50, repeats=31)
    med = {name: t.median * 1e3 for name, t in timings.items()}
    print({name: f"{ms:.4f} ms" for name, ms in med.items()}, f"raw/typed = {med['raw'] / med['typed']:.3f}")
