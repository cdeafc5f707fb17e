"""What each sharding layout costs the GPT's training step: per-device state bytes and the collectives XLA emits.

    python -m benchmarks.sharding_layouts [--d-model 256] [--layers 4] [--rules rules.json] [--json out.json]

On 8 simulated CPU devices, for each layout (replicated data parallelism, fsdp, tensor x fsdp, data x fsdp), the
train state (Adam) is created in its shards and the jitted step compiled; reported are the bytes of parameters
plus optimizer state on the fullest device (from the arrays' addressable shards) and, from the compiled HLO, the
count and result bytes of every all-gather, reduce-scatter, all-reduce and other collective in one step. The rules
in use (the built-in table, or `--rules`' JSON table) are named, with each layout's parameter bytes per device and
what each mesh axis alone leaves per device (`jaxnn.parallel.report`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from benchmarks.output import add_json_flags, refuse_existing

LAYOUTS = ("data=8", "fsdp=8", "tensor=8", "tensor=2,fsdp=4", "data=2,fsdp=4")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64|u8|pred)\[([\d,]*)\]")


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Count and result bytes of each collective op in an HLO module's text (async pairs counted once)."""
    found: dict[str, dict[str, int]] = {}
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            # "all-gather(" or the async "all-gather-start(" (its "-done" carries no new data).
            match = re.search(rf"=\s*(.*?)\s{op}(-start)?\(", line)
            if match is None:
                continue
            result = match.group(1)
            nbytes = sum(
                DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(result)
            )
            entry = found.setdefault(op, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
    return found


def measure(layout: str, d_model: int, layers: int, rules_path: str | None = None) -> dict:
    import jax
    import optax

    from jaxnn import parallel
    from jaxnn.models import GPT, GPTConfig
    from jaxnn.parallel import (
        BUILT_IN,
        batch_sharding,
        create_sharded_state,
        load_rules,
        make_mesh,
        replicated,
        shard_batch,
    )
    from jaxnn.train import create_train_state, language_model_loss, train_step_fn

    cfg = GPTConfig(seq_len=128, d_model=d_model, num_layers=layers, num_heads=8)
    model, tx = GPT(cfg), optax.adam(1e-3)
    mesh = make_mesh(8) if layout == "data=8" else parallel.make_mesh(layout)
    rules = BUILT_IN if rules_path is None else load_rules(rules_path)
    state = create_sharded_state(lambda: create_train_state(model, tx, jax.random.key(0), (16, 128)), mesh, rules)
    held = parallel.bytes_per_device((state.params, state.opt_state))
    report = parallel.layout_report(state.params, parallel.mesh_sizes(mesh), rules)
    tokens = jax.numpy.zeros((16, 129), jax.numpy.int32)
    batch = shard_batch({"x": tokens[:, :-1], "y": tokens[:, 1:]}, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(
        train_step_fn(model, language_model_loss, tx),
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
    )
    with jax.set_mesh(mesh):  # as jaxnn.parallel runs a sharded step: the blocks' activation constraints apply
        hlo = step.lower(state, batch).compile().as_text()
    return {
        "layout": layout,
        "rules": rules.name,
        "param_bytes": report.total_bytes,
        "param_bytes_per_device": max(parallel.bytes_per_device(state.params).values()),
        "param_bytes_per_device_by_axis": {f"{a.axis}={a.size}": a.bytes_per_device for a in report.axes},
        "state_bytes_per_device": max(held.values()),
        "collectives": collectives(hlo),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rules", default=None, help="a JSON rule table (default: the built-in rules)")
    add_json_flags(parser)
    args = parser.parse_args()
    refuse_existing(args.json, overwrite=args.overwrite)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    rows = [measure(layout, args.d_model, args.layers, args.rules) for layout in LAYOUTS]
    print(f"GPT d_model {args.d_model}, {args.layers} layers, T 128, batch 16, Adam; 8 simulated CPU devices")
    print(f"rules: {rows[0]['rules']}; parameters {rows[0]['param_bytes'] / 2**20:.2f} MiB in all")
    print(f"{'layout':<16} {'params MiB/device':>17} {'state MiB/device':>17}  collectives per step (count, MiB)")
    for r in rows:
        ops = ", ".join(f"{op} {v['count']} ({v['bytes'] / 2**20:.1f})" for op, v in sorted(r["collectives"].items()))
        params, state = r["param_bytes_per_device"] / 2**20, r["state_bytes_per_device"] / 2**20
        print(f"{r['layout']:<16} {params:>17.2f} {state:>17.2f}  {ops}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
