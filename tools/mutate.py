"""Planted bugs, one at a time, against the fast tests that should catch them: `make mutate`.

    python tools/mutate.py [--only NAME ...] [--jobs 2] [--json out.json]

Each mutation replaces one exact snippet of the library (it must occur exactly once, or the mutation is reported
stale) in a copy of the repository, runs the named tests there, and counts the bug as killed when they fail. A
bug that survives is a gap in the tests; docs/testing.md says why each known survivor remains. The list covers
the core modules (layers, precision, train, parallel, checkpoint, data) and the bugs that once slipped through.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
COPIED = ("jaxnn", "tests", "experiments", "benchmarks", "pyproject.toml")


class Mutation(NamedTuple):
    name: str
    path: str  # relative to the repository
    old: str  # the exact snippet replaced (must occur once)
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


MUTATIONS = (
    Mutation(
        "dropout: same mask on every device",
        "jaxnn/train/data_parallel.py",
        "device_key = jax.random.fold_in(state.key, lax.axis_index(axis_name))",
        "device_key = state.key",
        ("tests/test_parallel.py",),
    ),
    Mutation(
        "shard_map: gradient all-reduce in bf16",
        "jaxnn/train/data_parallel.py",
        "lax.psum(g.astype(jnp.float32), axis_name).astype(g.dtype)",
        "lax.psum(g, axis_name)",
        ("tests/test_parallel.py",),
    ),
    Mutation(
        "fp16 overflow keeps the new optimizer state",
        "jaxnn/train/step.py",
        "            opt_state = keep_new(opt_state, state.opt_state)\n",
        "",
        ("tests/test_train.py", "tests/test_precision.py"),
    ),
    Mutation(
        "fp16 overflow keeps the new BatchNorm state",
        "jaxnn/train/step.py",
        "            model_state = keep_new(model_state, state.model_state)\n",
        "",
        ("tests/test_train.py", "tests/test_precision.py"),
    ),
    Mutation(
        "same dropout key every step",
        "jaxnn/train/step.py",
        "key = jax.random.fold_in(state.key, state.step)",
        "key = state.key",
        ("tests/test_train.py",),
    ),
    Mutation(
        "loss scale never halves",
        "jaxnn/precision.py",
        "jnp.maximum(self.scale / 2, 1.0)",
        "self.scale",
        ("tests/test_precision.py",),
    ),
    Mutation(
        "bf16 products accumulate in bf16",
        "jaxnn/precision.py",
        "    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)",
        "    return jnp.einsum(spec, a, b)",
        ("tests/test_precision.py", "tests/test_layers.py"),
    ),
    Mutation(
        "AvgPool SAME divides by the full window",
        "jaxnn/layers/pool.py",
        "        return (sums / counts).astype(x.dtype)",
        "        return (sums / float(counts.max())).astype(x.dtype)",
        ("tests/test_layers.py", "tests/test_references.py"),
    ),
    Mutation(
        "LayerNorm statistics in the compute dtype",
        "jaxnn/layers/norm.py",
        "_scale_and_shift(_normalise(x.astype(accumulation_dtype(x.dtype)), (-1,), eps), params, x.dtype)",
        "_scale_and_shift(_normalise(x, (-1,), eps), params, x.dtype)",
        ("tests/test_layers.py", "tests/test_references.py"),
    ),
    Mutation(
        "BatchNorm momentum swapped",
        "jaxnn/layers/norm.py",
        '"mean": momentum * state["mean"] + (1 - momentum) * mean,',
        '"mean": (1 - momentum) * state["mean"] + momentum * mean,',
        ("tests/test_layers.py", "tests/test_references.py", "tests/test_flax_parity.py"),
    ),
    Mutation(
        "restore returns the template's optimizer state and step",
        "jaxnn/checkpoint.py",
        '            return state, meta.get("data", {}), step',
        "            state = state._replace(opt_state=like_state.opt_state, step=like_state.step)\n"
        '            return state, meta.get("data", {}), step',
        ("tests/test_checkpoint.py",),
    ),
    Mutation(
        "restore skips the digest check",
        "jaxnn/checkpoint.py",
        'if state_digest(state) != meta.get("digest"):',
        "if False:",
        ("tests/test_checkpoint.py",),
    ),
    Mutation(
        "every epoch in the same order",
        "jaxnn/data/pipeline.py",
        "np.random.default_rng([seed, 0, epoch])",
        "np.random.default_rng([seed, 0, 0])",
        ("tests/test_loop.py::test_array_batches_are_a_function_of_seed_and_step", "tests/test_data.py"),
    ),
    Mutation(
        "padded evaluation rows counted",
        "jaxnn/data/sources.py",
        'batch["mask"] = real.astype(np.float32)',
        'batch["mask"] = np.ones_like(real, np.float32)',
        ("tests/test_loop.py::test_every_data_form_trains",),
    ),
    Mutation(
        "a failed metrics append leaves half a line",
        "jaxnn/_src/storage.py",
        "                os.ftruncate(fd, size)",
        "                pass",
        ("tests/system/test_faults.py::test_disk_full_while_logging",),
    ),
    Mutation(
        "the lock never refuses",
        "jaxnn/_src/run_lock.py",
        "                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "                pass",
        ("tests/system/test_faults.py::test_lock_on_the_same_directory_twice_in_one_process",),
    ),
)


def prepare(root: pathlib.Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, root / name)


def run_tests(root: pathlib.Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, float, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:warnings", *tests]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0, "timeout"
    lines = out.stdout.strip().splitlines() or [""]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return out.returncode, time.monotonic() - t0, (failed or lines)[-1][:160]


def mutate(m: Mutation, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxnn-mutate-") as tmp:
        root = pathlib.Path(tmp)
        prepare(root)
        target = root / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            return {"name": m.name, "outcome": "stale", "detail": f"snippet found {text.count(m.old)} times"}
        target.write_text(text.replace(m.old, m.new))
        code, seconds, last = run_tests(root, m.tests, timeout)
    outcome = "timeout" if code is None else "survived" if code == 0 else "killed"
    return {"name": m.name, "outcome": outcome, "seconds": round(seconds, 1), "detail": last}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", default=None, help="run only mutations whose name contains one of these")
    p.add_argument("--jobs", type=int, default=2, help="mutations tested at once (one pytest process each)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(s in m.name for s in args.only)]
    if not chosen:
        print(f"mutate: no planted bug's name contains any of {args.only}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="jaxnn-mutate-base-") as tmp:
        prepare(pathlib.Path(tmp))
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, seconds, last = run_tests(pathlib.Path(tmp), tests, args.timeout * 2)
    if code != 0:
        print(f"the tests fail without any planted bug ({last}); fix them first", file=sys.stderr)
        return 2
    print(f"baseline: {len(tests)} test selections pass ({seconds:.0f} s)")
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda m: mutate(m, args.timeout), chosen))
    for r in results:
        print(f"  {r['outcome']:8s} {r['name']}  ({r.get('seconds', '-')} s; {r['detail']})")
    survivors = [r for r in results if r["outcome"] != "killed"]
    print(f"{len(results) - len(survivors)} of {len(results)} planted bugs killed in {time.monotonic() - t0:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
