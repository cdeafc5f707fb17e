"""Side by side: jaxnn's tiny-MLP train step vs plain jax.jit + Flax Linen + optax (same shapes, Adam).

jaxnn's step also returns accuracy and the gradient norm and carries the step counter and PRNG key; the Flax
step returns only the loss. Both Flax forms are timed: without donation (the issue's "plain jax.jit") and with.

Run: `.venv/bin/python benchmarks/tiny_vs_plain_jit.py`; interleaved windows, medians, one process.
"""
import jax, optax
import flax.linen as nn
from jaxnn import layers as L, train
from jaxnn.bench import time_interleaved

B, D, H, C = 32, 16, 32, 10
x = jax.random.normal(jax.random.key(1), (B, D)); y = jax.random.randint(jax.random.key(2), (B,), 0, C)
batch = {"x": x, "y": y}
tx = optax.adam(1e-3)

model = L.serial(L.Dense(H), L.Relu, L.Dense(C))
state = train.create_train_state(model, tx, jax.random.key(0), (B, D))
step = train.make_train_step(model, train.classification_loss, tx)

class M(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(C)(nn.relu(nn.Dense(H)(x)))
fm = M(); fparams = fm.init(jax.random.key(0), x); fopt = tx.init(fparams)
dparams, dopt = jax.tree.map(jax.numpy.copy, (fparams, fopt))


def plain_step(params, opt, x, y):
    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(fm.apply(p, x), y).mean()
    l, g = jax.value_and_grad(loss)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt, l


fstep = jax.jit(plain_step)  # "plain jax.jit", as the issue measured it
fstep_donated = jax.jit(plain_step, donate_argnums=(0, 1))  # the same with buffer donation, as jaxnn's step has

def jaxnn_step():
    global state
    state, _ = step(state, batch)
    return state


def flax_step():
    global fparams, fopt
    fparams, fopt, _ = fstep(fparams, fopt, x, y)
    return fparams


def flax_donated_step():
    global dparams, dopt
    dparams, dopt, _ = fstep_donated(dparams, dopt, x, y)
    return dparams


timings = time_interleaved({"jaxnn": jaxnn_step, "flax": flax_step, "flax_donated": flax_donated_step},
                           warmup=50, repeats=31)
med = {name: t.median * 1e3 for name, t in timings.items()}
print({k: f"{v:.4f} ms" for k, v in med.items()}, f"jaxnn/flax = {med['jaxnn'] / med['flax']:.2f}",
      f"jaxnn/flax_donated = {med['jaxnn'] / med['flax_donated']:.2f}")
