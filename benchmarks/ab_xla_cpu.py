"""What XLA's CPU backend offers, side by side in one process: compiler options per executable, and dot forms.

    PYTHONPATH=. python benchmarks/ab_xla_cpu.py dots [--size 2048]
    PYTHONPATH=. python benchmarks/ab_xla_cpu.py steps [--models cnn gpt] [--precisions fp32 bf16]

`dots`: GFLOP/s of f32 x f32 -> f32, bf16 x bf16 -> f32 (`preferred_element_type`) and bf16 x bf16 -> bf16 products
under each option set, and PyTorch's f32 and bf16 products when torch is importable (same process, same
windows). `steps`: the benchmark models' jitted train steps (benchmarks.train_steps.SPECS) compiled under each
option set. Option sets are XLA DebugOptions passed to `Lowered.compile(compiler_options=...)`, so every variant
is timed in the same windows (`jaxnn.profile.timing.time_interleaved`); the ratio to "default" is the figure to read.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from benchmarks.isa import add_isa_flag, restart_capped
from benchmarks.machine import cpu_label
from jaxnn.profile.timing import stepper, time_interleaved

# XLA's CPU backend hands dots and convolutions to YNNPACK fusions by default (the compiled HLO shows
# `__ynn_fusion` custom fusions); fusion types are the DebugOptions.LibraryFusionType enum names.
YNN = "xla_cpu_experimental_ynn_fusion_type"
OPTION_SETS: dict[str, dict] = {
    "default": {},
    "ynn off (Eigen dots)": {YNN: ""},
    "ynn dot only": {YNN: "LIBRARY_FUSION_TYPE_DOT"},
    "ynn dot,eltwise,reduce": {YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
    "xnn dot (ynn off)": {YNN: "", "xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn (ynn off)": {
        YNN: "",
        "xla_cpu_use_onednn": True,
        "xla_cpu_experimental_onednn_custom_call": True,
        "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
    },
    "no xnnpack": {"xla_cpu_use_xnnpack": False},
    "vector width 512": {"xla_cpu_prefer_vector_width": 512},
}


def compile_all(fn, args, sets: list[str]) -> dict:
    lowered = jax.jit(fn).lower(*args)
    out = {}
    for name in sets:
        try:
            out[name] = lowered.compile(compiler_options=OPTION_SETS[name] or None)
        except Exception as err:  # an option this jaxlib rejects: report it and go on
            print(f"  {name}: does not compile: {type(err).__name__}: {str(err)[:160]}")
    return out


def dots(size: int, sets: list[str], repeats: int) -> None:
    key = jax.random.key(0)
    a32 = jax.random.normal(key, (size, size), jnp.float32)
    b32 = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.float32)
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    forms = {
        "f32 x f32 -> f32": (lambda a, b: a @ b, (a32, b32)),
        "bf16 x bf16 -> f32": (lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32), (a16, b16)),
        "bf16 x bf16 -> bf16": (lambda a, b: a @ b, (a16, b16)),
    }
    fns = {}
    for form, (fn, args) in forms.items():
        for name, compiled in compile_all(fn, args, sets).items():
            fns[f"{form} | {name}"] = lambda c=compiled, args=args: c(*args)
    try:
        import numpy as np
        import torch

        t32 = torch.from_numpy(np.array(a32)), torch.from_numpy(np.array(b32))
        t16 = t32[0].bfloat16(), t32[1].bfloat16()
        done = jnp.zeros(())  # torch runs synchronously on the CPU; the timer waits on a ready jax array
        fns["f32 x f32 -> f32 | pytorch"] = lambda: (torch.mm(*t32), done)[1]
        fns["bf16 x bf16 -> bf16 | pytorch"] = lambda: (torch.mm(*t16), done)[1]
    except ImportError:
        print("  (torch not importable: no PyTorch rows)")
    timings = time_interleaved(fns, repeats=repeats, min_window_s=0.2)
    flops = 2.0 * size**3
    print(f"{size}^3 products, GFLOP/s (median of {repeats} interleaved windows); {cpu_label()}, jax {jax.__version__}")
    for name, t in timings.items():
        print(f"  {name:<42} {flops / t.median / 1e9:8.1f}")


def steps(models: list[str], precisions: list[str], sets: list[str], repeats: int) -> None:
    from benchmarks.train_steps import LEARNING_RATE, jaxnn_model, synthetic_batch
    from jaxnn import train

    print(f"train step ms (median of {repeats} interleaved windows), ratio to default; {cpu_label()}")
    for model_name in models:
        for precision in precisions:
            model, loss_fn = jaxnn_model(model_name)
            tx = optax.adam(LEARNING_RATE)
            batch = jax.tree.map(jnp.asarray, synthetic_batch(model_name))
            state = train.create_train_state(model, tx, jax.random.key(0), batch["x"].shape, precision)
            step = train.make_train_step(model, loss_fn, tx, precision, donate=False, grad_norm=False)
            lowered = step.lower(state, batch)
            fns = {}
            for name in sets:
                try:
                    compiled = lowered.compile(compiler_options=OPTION_SETS[name] or None)
                except Exception as err:
                    print(f"  {model_name} {precision} {name}: does not compile: {str(err)[:160]}")
                    continue
                fns[name] = stepper(compiled, state, batch)
            timings = time_interleaved(fns, repeats=repeats, warmup=1)
            base = timings["default"].median
            cells = ", ".join(f"{n} {1e3 * t.median:.1f} ({t.median / base:.2f})" for n, t in timings.items())
            print(f"  {model_name} {precision}: {cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("dots", "steps"))
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--sets", nargs="+", default=list(OPTION_SETS), choices=list(OPTION_SETS))
    parser.add_argument("--models", nargs="+", default=["cnn", "gpt"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=7)
    add_isa_flag(parser)
    args = parser.parse_args()
    restart_capped(args.isa)
    if "default" not in args.sets:
        args.sets = ["default", *args.sets]
    if args.what == "dots":
        dots(args.size, args.sets, args.repeats)
    else:
        steps(args.models, args.precisions, args.sets, args.repeats)


if __name__ == "__main__":
    main()
