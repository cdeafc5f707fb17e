"""Side by side: convolution lowerings on the benchmark CNN's three layers (batch 64, 3x3 SAME, fp32).

Run: `PYTHONPATH=. .venv/bin/python benchmarks/ab_conv.py`; interleaved windows, medians, one process. Per layer:
forward, weight gradient (dw, as a first layer needs) and both gradients (dw+dx), for
- xla: XLA's convolution op (`Conv(lowering="xla")`);
- im2col: one matmul over the concatenated kernel taps (`Conv(lowering="im2col")`, the CPU default);
- hybrid: XLA's forward and input-gradient convolutions with the weight gradient as patches^T @ dy (tried and
  dropped; defined here only);
and the scan cliff: two weight-gradient steps unrolled against the same inside `lax.scan`, for xla and im2col.
Figures and what they decided: docs/performance.md, "im2col convolutions".
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from jaxnn.layers import conv as conv_module
from jaxnn.profile.timing import time_interleaved

LAYERS = [((64, 32, 32, 3), 32), ((64, 16, 16, 32), 64), ((64, 8, 8, 64), 128)]
DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def xla(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DIMENSIONS)


def im2col(x, w):
    return conv_module.conv_im2col(x, w, (1, 1), "SAME", (1, 1))


@jax.custom_vjp
def hybrid(x, w):
    return xla(x, w)


def _hybrid_fwd(x, w):
    return xla(x, w), (x, w)


def _hybrid_bwd(residuals, g):
    x, w = residuals
    dx = jax.vjp(lambda x: xla(x, w), x)[1](g)[0]
    patches = conv_module.im2col_patches(x, w.shape[:2], (1, 1), "SAME", (1, 1))
    dw = jnp.einsum("nhwk,nhwf->kf", patches, g).reshape(w.shape)
    return dx, dw


hybrid.defvjp(_hybrid_fwd, _hybrid_bwd)
LOWERINGS = {"xla": xla, "im2col": im2col, "hybrid": hybrid}


def per_layer():
    fns = {}
    for shape, features in LAYERS:
        x = jax.random.normal(jax.random.key(0), shape)
        w = jax.random.normal(jax.random.key(1), (3, 3, shape[-1], features)) / (3 * shape[-1] ** 0.5)
        tag = f"{shape[1]}x{shape[1]}x{shape[3]}->{features}"
        for name, conv in LOWERINGS.items():
            loss = lambda w, x, conv=conv: jnp.sum(jnp.sin(conv(x, w)))  # noqa: E731
            forward, dw = jax.jit(conv), jax.jit(jax.grad(loss))
            both = jax.jit(jax.grad(loss, argnums=(0, 1)))
            if name != "hybrid":  # hybrid's forward is xla's
                fns[f"{tag} {name} fwd"] = lambda f=forward, x=x, w=w: f(x, w)
            fns[f"{tag} {name} dw"] = lambda f=dw, x=x, w=w: f(w, x)
            fns[f"{tag} {name} dw+dx"] = lambda f=both, x=x, w=w: f(w, x)
    return fns


def scan_cliff():
    x = jax.random.normal(jax.random.key(0), (64, 16, 16, 32))
    w = jax.random.normal(jax.random.key(1), (3, 3, 32, 64)) / 30.0
    fns = {}
    for name in ("xla", "im2col"):
        dw = jax.grad(lambda w, x, conv=LOWERINGS[name]: jnp.sum(jnp.sin(conv(x, w))))

        def unrolled(w, x, dw=dw):
            return dw(dw(w, x) * 1e-3 + w, x)

        def scanned(w, x, dw=dw):
            return lax.scan(lambda w, _: (dw(w, x) * 1e-3 + w, None), w, None, length=2)[0]

        for label, f in (("unrolled", unrolled), ("scan", scanned)):
            fns[f"2 weight grads 16x16x32->64 {name} {label}"] = functools.partial(jax.jit(f), w, x)
    return fns


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timing windows per case (1: a smoke run)")
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    print(f"median ms of {args.repeats} interleaved windows; {cpu_label()}, jax {jax.__version__}")
    for group in (per_layer(), scan_cliff()):
        for name, t in time_interleaved(group, warmup=2, repeats=args.repeats).items():
            print(f"{name:45s} {t.median * 1e3:8.2f} ms")
