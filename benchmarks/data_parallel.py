"""Step time and throughput of the three data-parallel forms against device count (`make bench-parallel`).

python -m benchmarks.data_parallel [--devices 1 2 4 8] [--global-batch 256] [--scaling strong|weak]
"""

# All device counts are measured in one process (meshes over the first n devices), so their ratios are comparable
# on a noisy machine. On the CPU the devices are simulated and share the host's cores: the numbers then measure
# the overhead of each form, not scaling.

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.output import add_json_flags, refuse_existing


def bench(forms, device_counts, *, global_batch: int, scaling: str, model_name: str, repeats: int) -> list[dict]:
    import jax
    import numpy as np

    from jaxnn import parallel
    from jaxnn.models import CONFIGS, get_model
    from jaxnn.profile.timing import stepper, time_fn
    from jaxnn.train import classification_loss, create_train_state, make_optimizer
    from jaxnn.train.data_parallel import data_parallel_train_step

    model = get_model(model_name, CONFIGS[model_name]())
    tx = make_optimizer(1e-3)
    rng = np.random.default_rng(0)
    rows, base = [], {}
    for n in device_counts:
        batch_size = global_batch if scaling == "strong" else global_batch * n
        batch = {
            "x": rng.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
            "y": rng.integers(0, 10, size=(batch_size,)).astype(np.int32),
        }
        steps = {}
        for form in forms:
            dp = data_parallel_train_step(model, classification_loss, tx, mesh=parallel.make_mesh(n), form=form)
            state = create_train_state(model, tx, jax.random.key(0), batch["x"].shape)
            steps[form] = stepper(dp.step, dp.place_state(state), dp.place_batch(batch))
        # Rounds that alternate between the forms: load from other users of the machine then lands on every form
        # alike, so the forms compare fairly even when absolute times drift.
        number = {form: time_fn(fn, repeats=1).number for form, fn in steps.items()}
        per_call = {form: [] for form in forms}
        for _ in range(repeats):
            for form, fn in steps.items():
                per_call[form].append(time_fn(fn, warmup=0, repeats=1, number=number[form]).median)
        for form in forms:
            t = np.asarray(per_call[form])
            throughput = batch_size / float(np.median(t))
            base.setdefault(form, throughput)
            rows.append(
                {
                    "form": form,
                    "devices": n,
                    "global_batch": batch_size,
                    "step_ms": float(np.median(t)) * 1e3,
                    "step_ms_iqr": [float(q) * 1e3 for q in np.percentile(t, [25, 75])],
                    "examples_per_s": throughput,
                    "efficiency": throughput / (base[form] * n / device_counts[0]),
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--forms", nargs="+", default=["jit", "shard_map", "pmap"])
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--global-batch", type=int, default=256, help="per step; per device with --scaling weak")
    p.add_argument(
        "--scaling",
        default="strong",
        choices=("strong", "weak"),
        help="strong: the same global batch for every device count; weak: the same batch per device",
    )
    p.add_argument("--repeats", type=int, default=7)
    add_json_flags(p, "also write the rows here as JSON lines")
    args = p.parse_args(argv)
    refuse_existing(args.json, overwrite=args.overwrite)

    from jaxnn.parallel import configure_cpu_devices

    configure_cpu_devices(max(args.devices))  # affects only the CPU platform
    import jax

    counts = [n for n in args.devices if n <= jax.device_count()]
    skipped = sorted(set(args.devices) - set(counts))
    platform = jax.default_backend()
    print(
        f"platform {platform}: {jax.device_count()} devices ({jax.devices()[0].device_kind}); model {args.model}, "
        f"{args.scaling} scaling, batch {args.global_batch}{' per device' if args.scaling == 'weak' else ''}"
    )
    if platform == "cpu":
        print(
            "NOTE: simulated CPU devices share this host's cores, so these figures measure the overhead of each "
            "form, not scaling; run on a multi-GPU machine for scaling efficiency."
        )
    if skipped:
        print(f"skipped device counts {skipped}: only {jax.device_count()} devices")
    rows = bench(
        args.forms,
        counts,
        global_batch=args.global_batch,
        scaling=args.scaling,
        model_name=args.model,
        repeats=args.repeats,
    )
    print(
        f"{'form':<10} {'devices':>7} {'batch':>6} {'step ms':>9} {'IQR ms':>15} {'examples/s':>11} {'efficiency':>10}"
    )
    for r in rows:
        iqr = f"{r['step_ms_iqr'][0]:.2f}-{r['step_ms_iqr'][1]:.2f}"
        print(
            f"{r['form']:<10} {r['devices']:>7} {r['global_batch']:>6} {r['step_ms']:>9.2f} {iqr:>15} "
            f"{r['examples_per_s']:>11.0f} {r['efficiency']:>10.0%}"
        )
    print(f"efficiency = throughput(n) / (n/{counts[0]} x throughput({counts[0]})), per form")
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps({**r, "platform": platform, "scaling": args.scaling}) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
