"""The projected GPU column's inputs: each experiment's programs compiled here, at the sizes this machine measured,
and their costs (XLA's FLOPs and bytes, the kernels they launch, their loop iterations, the bytes a request copies
in and out), written to `results/projected/costs.json`. The report applies `jaxnn.profile.projection.GpuModel` to
them, so a change of the model's parameters needs no recompilation. Nothing is run, only compiled. The
experiments a GPU run measures at its own sizes (`AT_GPU_RUN_SIZES`) are compiled at those too, each row marked
with its "size", so that the report sets a GPU measurement against the projection of the program it ran.

Each program is lowered for a GPU (`LOWERED_FOR`) and compiled by this CPU's compiler: the layers take their GPU
lowering (XLA's convolution, reading input and weights and writing its output in one operation), not this CPU's
(im2col's patch copies, or oneDNN kernels where this CPU measured them faster), so the costs do not depend on which
CPU compiled them, beyond its fusions; each product and convolution stays a kernel of its own, as on a GPU.

`python -m experiments.projected [--size quick] [--out results]` (`make project-gpu`). Compiling on the CPU gives
the CPU compiler's fusions, not a GPU compiler's: the kernel count is an estimate, and so is every figure
projected from it: projected, not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, exp_inference, exp_matmul, exp_parallel, exp_pipeline, exp_precision, exp_sequential
from jaxnn.layers.core import init_model
from jaxnn.models import CNN, GPT, MLP, CNNConfig
from jaxnn.profile import program_cost as costs_of
from jaxnn.profile.projection import ProgramCost
from jaxnn.train import classification_loss, create_train_state, make_optimizer, make_predict, train_step_fn

FOLDER = "projected"  # results/<FOLDER>/ is not a machine: the report reads it apart from the measured folders
# The platform every program is lowered for before this CPU compiles it: a GPU's, so that each layer takes the
# lowering a GPU runs (XLA's convolution, not this CPU's im2col or oneDNN kernels, whichever it measured faster).
LOWERED_FOR = "cuda"


def program_cost(fn, args: tuple, kind: str, h2d: float = 0.0, d2h: float = 0.0, **options) -> ProgramCost:
    """`jaxnn.profile.program_cost.program_cost` of `fn` lowered for the GPU (`LOWERED_FOR`), compiled here."""
    return costs_of.program_cost(fn, args, kind, h2d, d2h, platform=LOWERED_FOR, **options)


def _spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _nbytes(shape, dtype) -> float:
    return float(np.prod(shape)) * jnp.dtype(dtype).itemsize


# ------------------------------------------------------------------------------------------------ the programs


def matmul_costs(size: str) -> list[dict]:
    sizes = sorted(set(common.preset(exp_matmul.SIZES, size)["cpu"]) | set(exp_matmul.SIZES["gpu"]["gpu"]))
    out = []
    for n in sizes:
        for dname, dtype in exp_matmul.DTYPES.items():
            cost = program_cost(exp_matmul._product(dtype), (_spec((n, n), dtype),) * 2, _kind(dtype, "HIGHEST"))
            out.append({"dtype": dname, "n": n, **_as_dict(cost)})
    return out


def _kind(dtype, precision: str | None) -> str:
    """What arithmetic a GPU runs a product in: bf16/fp16 tensor cores; fp32 on CUDA cores at precision HIGHEST,
    else TF32 tensor cores (jax's default precision on a GPU)."""
    name = jnp.dtype(dtype).name
    if name in ("bfloat16", "float16"):
        return "bf16" if name == "bfloat16" else "fp16"
    return "fp32" if precision == "HIGHEST" else "tf32"


def precision_costs(size: str) -> list[dict]:
    # Claim 3 compares a GPU with itself, so at the GPU run's size: the size its measured figures come from.
    n = exp_precision.MATMUL_N["gpu" if size != "tiny" else "tiny"]
    out = []
    for mode, (dtype, precision, preferred) in exp_precision.MODES.items():
        fn = exp_precision._matmul(precision, preferred)
        cost = program_cost(fn, (_spec((n, n), dtype),) * 2, _kind(dtype, getattr(precision, "name", None)))
        out.append({"op": "matmul", "mode": mode, "n": n, **_as_dict(cost)})
    return out


def sequential_costs(size: str) -> list[dict]:
    steps = common.preset(exp_sequential.STEPS, size)
    out = []
    for hidden in common.preset(exp_sequential.HIDDEN, size):
        h, s = _spec((hidden,)), _spec((hidden, hidden))
        cases = {
            "chain": (exp_sequential.make_chain(steps), (s, h)),
            "rnn": (exp_sequential.make_rnn(), (s, s, h, h, _spec((steps, hidden)))),
            "chain_parallel": (exp_sequential.make_parallel(), (_spec((steps, hidden)), s)),
            "rnn_parallel": (exp_sequential.make_parallel(), (_spec((steps, 2 * hidden)), _spec((2 * hidden, hidden)))),
        }
        for case, (fn, args) in cases.items():
            cost = program_cost(fn, args, "tf32", loop_is_all=True)
            out.append({"case": case, "hidden": hidden, "steps": steps, **_as_dict(cost)})
    return out


def inference_costs(size: str) -> list[dict]:
    batches = sorted(set(common.preset(exp_inference.BATCHES, size)["cpu"]) | set(exp_inference.BATCHES["gpu"]["gpu"]))
    out = []
    for name, cfg in common.preset(exp_inference.MODELS, size).items():
        model = CNN(cfg) if name == "cnn" else GPT(cfg)
        shape = (1, *exp_inference.IMAGE) if name == "cnn" else (1, cfg.seq_len)
        _, params, state = init_model(model, jax.random.key(0), shape)
        predict = make_predict(model)
        for batch in batches:
            x = _spec((batch, *shape[1:]), jnp.float32 if name == "cnn" else jnp.int32)
            logits = jax.eval_shape(predict, params, state, x)
            cost = program_cost(
                predict, (params, state, x), "tf32", _nbytes(x.shape, x.dtype), _nbytes(logits.shape, logits.dtype)
            )
            out.append({"model": name, "batch": batch, **_as_dict(cost)})
    return out


def program_cost_of_train_step(model, in_shape, batch: int, step=None) -> ProgramCost:
    """The cost of `step` (default: a classification train step of `model` with Adam) on a batch of `in_shape`."""
    tx = make_optimizer(1e-3)
    state = jax.eval_shape(lambda: create_train_state(model, tx, jax.random.key(0), (batch, *in_shape)))
    step = step or train_step_fn(model, classification_loss, tx)
    data = {"x": _spec((batch, *in_shape)), "y": _spec((batch,), jnp.int32)}
    return program_cost(jax.jit(step), (state, data), "tf32", _nbytes((batch, *in_shape), jnp.float32))


def parallel_costs(size: str) -> list[dict]:
    cfg = common.preset(exp_parallel.CONFIG, size)
    model = CNN(cfg["cfg"]) if cfg["model"] == "cnn" else MLP(cfg["cfg"])
    return [
        {"global_batch": b, **_as_dict(program_cost_of_train_step(model, exp_parallel.IMAGE, b))}
        for b in sorted(set(cfg["sweep"]) | {4096})
    ]


def pipeline_costs(size: str) -> list[dict]:
    cfg = common.preset(exp_pipeline.CONFIG, size)
    model, batch = CNN(CNNConfig(widths=cfg["widths"])), cfg["batch"]
    tx = make_optimizer(1e-3)
    base = train_step_fn(model, classification_loss, tx)
    plain = program_cost_of_train_step(model, exp_pipeline.IMAGE, batch)
    out = [{"step": "plain", "cost": 0, **_as_dict(plain)}]
    x = _spec((batch, *exp_pipeline.IMAGE))
    once = program_cost(jax.jit(lambda x: exp_pipeline.device_augment(x, jax.random.key(1), 1)), (x,), "tf32")
    for c in cfg["costs"]:

        def step(state, data, c=c):
            key = jax.random.fold_in(jax.random.key(1), state.step)
            return base(state, {**data, "x": exp_pipeline.device_augment(data["x"], key, c)})

        # Kernels and loop iterations from the step as compiled; its work is the plain step's and c augmentations'.
        cost = program_cost_of_train_step(model, exp_pipeline.IMAGE, batch, step)
        work = {"flops": plain.flops + c * once.flops, "nbytes": plain.nbytes + c * once.nbytes}
        out.append({"step": "device", "cost": c, **_as_dict(cost), **work})
    return out


COLLECTORS = {
    "exp_matmul": matmul_costs,
    "exp_precision": precision_costs,
    "exp_sequential": sequential_costs,
    "exp_inference": inference_costs,
    "exp_parallel": parallel_costs,
    "exp_pipeline": pipeline_costs,
}


def _as_dict(cost: ProgramCost) -> dict:
    return {k: getattr(cost, k) for k in ProgramCost.__dataclass_fields__}


# A GPU run measures these at its own preset's sizes (another CNN, batch or model than the CPU's): their programs
# are compiled at those sizes too, so that a GPU measurement is set against the projection of the same program.
GPU_RUN_SIZE = "gpu"
AT_GPU_RUN_SIZES = ("exp_inference", "exp_parallel", "exp_pipeline")


def collect(size: str = "quick", only: list[str] | None = None) -> dict:
    """{"size", "date", "programs": {experiment: [row key fields + ProgramCost fields]}}; each row's "size" is
    the preset it was compiled at: `size`, and the GPU run's for the experiments it measures at its own sizes
    (not for "tiny", the smoke runs' size)."""
    programs = {}
    for name, fn in COLLECTORS.items():
        if only is not None and name not in only:
            continue
        programs[name] = [{"size": size, **row} for row in fn(size)]
        if name in AT_GPU_RUN_SIZES and size not in ("tiny", GPU_RUN_SIZE):
            programs[name] += [{"size": GPU_RUN_SIZE, **row} for row in fn(GPU_RUN_SIZE)]
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {
        "kind": "projection costs",
        "size": size,
        "date": date,
        "compiled_on": common.machine_tag(),
        "lowered_for": LOWERED_FOR,
        "programs": programs,
    }


def load(results_root: str | Path) -> dict | None:
    """The program costs under `results_root`: a rerun's `costs-local.json` where one was written beside the
    committed file (`experiments.common.output_path`), else `costs.json`, else None."""
    folder = Path(results_root) / FOLDER
    path = next((p for p in (folder / f"costs{common.LOCAL}.json", folder / "costs.json") if p.is_file()), None)
    return json.loads(path.read_text()) if path is not None else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.projected", description=__doc__)
    parser.add_argument("--size", choices=common.SIZES, default="quick", help="the preset the CPU runs measured")
    parser.add_argument("--out", default="results", help="results folder; writes <out>/projected/costs.json")
    common.add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    common.set_overwrite(args.overwrite)
    path = common.output_path(Path(args.out) / FOLDER / "costs.json")
    costs = collect(args.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"projected: wrote {path} ({sum(len(v) for v in costs['programs'].values())} programs, {args.size} sizes)")


if __name__ == "__main__":
    main()
