"""bf16 backward products on XLA's CPU backend: the transposed operands behind a 2-D barrier (before) against a
barrier on flattened copies (`jaxnn.precision._canonical_einsum` now), side by side in one process.

    PYTHONPATH=. python benchmarks/ab_bf16_layout.py [--models gpt cnn] [--repeats 9]

Both variants are the benchmark models' bf16 jitted train steps (benchmarks.train_steps.SPECS); "before" swaps in
the previous `_canonical_einsum` while tracing. Also printed: how many of the compiled step's dots take f32
operands (XLA upcast them) in each variant.
"""

from __future__ import annotations

import argparse
import contextlib
import re

import jax
import jax.numpy as jnp
import optax
from jax import lax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from jaxnn import precision, train
from jaxnn.profile.timing import stepper, time_interleaved


def _canonical_einsum_2d_barrier(spec_x, spec_y, spec_out, x, y):
    batch = [c for c in spec_x if c in spec_y and c in spec_out]
    contracted = [c for c in spec_x if c in spec_y and c not in spec_out]
    order_x = batch + [c for c in spec_x if c not in spec_y] + contracted
    order_y = batch + contracted + [c for c in spec_y if c not in spec_x]
    x = jnp.transpose(x, [spec_x.index(c) for c in order_x])
    y = jnp.transpose(y, [spec_y.index(c) for c in order_y])
    x, y = lax.optimization_barrier((x, y))
    return jnp.einsum(f"{''.join(order_x)},{''.join(order_y)}->{spec_out}", x, y, preferred_element_type=jnp.float32)


@contextlib.contextmanager
def before():
    saved = precision._canonical_einsum
    precision._canonical_einsum = _canonical_einsum_2d_barrier
    try:
        yield
    finally:
        precision._canonical_einsum = saved


def f32_dots(hlo: str) -> tuple[int, int]:
    """(dots whose left operand is f32, all dots) in a compiled module's text; the step's own operands are bf16,
    so an f32 operand is one XLA upcast."""
    dtype_of = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    dtype_of.update(re.findall(r"(%?[\w.\-]+): (\w+)\[", hlo))  # computation parameters
    lhs = re.findall(r" dot\((%?[\w.\-]+),", hlo)
    return sum(dtype_of.get(name, dtype_of.get("%" + name)) == "f32" for name in lhs), len(lhs)


def main() -> None:
    from benchmarks.train_steps import LEARNING_RATE, jaxnn_model, synthetic_batch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn"])
    parser.add_argument("--repeats", type=int, default=9)
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    print(f"bf16 train step, ms (median of {args.repeats} interleaved windows); {cpu_label()}, jax {jax.__version__}")
    for name in args.models:
        model, loss_fn = jaxnn_model(name)
        tx = optax.adam(LEARNING_RATE)
        batch = jax.tree.map(jnp.asarray, synthetic_batch(name))
        state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, "bf16")
        fns, dots = {}, {}
        for variant in ("before", "flat barrier"):
            step = train.make_train_step(model, loss_fn, tx, "bf16", donate=False, grad_norm=False)
            with before() if variant == "before" else contextlib.nullcontext():
                compiled = step.lower(state, batch).compile()
            dots[variant] = f32_dots(compiled.as_text())
            fns[variant] = stepper(compiled, state, batch)
        t = time_interleaved(fns, repeats=args.repeats, warmup=1)
        ratio = t["flat barrier"].median / t["before"].median
        cells = ", ".join(
            f"{v} {1e3 * t[v].median:.1f} ms ({dots[v][0]} of {dots[v][1]} dots upcast to f32)" for v in fns
        )
        print(f"  {name}: {cells}; flat/before {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
