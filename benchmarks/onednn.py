"""`make bench-onednn`: jaxnn's optional oneDNN kernels against XLA's and PyTorch's, on this CPU.

First the primitives: GFLOP/s of the CNN's three convolutions (forward; backward = input and weight gradients) in
fp32 and bf16, and of the GPT's bf16 products (forward; backward = both gradients), for XLA (what jaxnn runs
without the kernels: im2col and XLA's dot, and XLA's own convolution), the oneDNN kernels, and PyTorch. Then the CNN
and GPT training steps: jaxnn, jaxnn with the kernels (`jaxnn_onednn`) and PyTorch, through `benchmarks.peers`.
Each framework runs in its own process; `--rounds N` alternates the processes N times and reports medians over
rounds, and within a process the variants are timed side by side (`jaxnn.profile.timing.time_interleaved`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.machine import cpu_label
from benchmarks.output import add_json_flags, refuse_existing

# The CNN benchmark's convolutions (benchmarks/train_steps.py SPECS["cnn"]: batch 64, 32x32x3, widths 32-64-128,
# 3x3 SAME, a 2x2 pool between them): (N, H, W, C, features).
CONVS = [(64, 32, 32, 3, 32), (64, 16, 16, 32, 64), (64, 8, 8, 64, 128)]
# The GPT benchmark's products (batch 16 x T 128 = 2048 tokens, d 256): (M, K, N) of x @ w, and the 2048^3 GEMM.
GEMMS = [(2048, 256, 768), (2048, 256, 1024), (2048, 1024, 256), (2048, 2048, 2048)]
PRECISIONS = ("fp32", "bf16")
MASK = [True, True, False]  # aten.convolution_backward: the input and weight gradients, no bias


def conv_flops(n, h, w, c, f) -> float:
    return 2.0 * n * h * w * 9 * c * f


def _jax_conv_cases(shape, precision: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxnn import precision as prec
    from jaxnn.kernels import onednn
    from jaxnn.layers.conv import conv_im2col

    n, h, w, c, f = shape
    dtype = jnp.float32 if precision == "fp32" else jnp.bfloat16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, h, w, c)), dtype)
    k = jnp.asarray(rng.standard_normal((3, 3, c, f)), dtype)
    g = jnp.asarray(rng.standard_normal((n, h, w, f)), jnp.float32)
    numbers = ("NHWC", "HWIO", "NHWC")
    impls = {
        "xla_conv": lambda x, k: prec.conv(x, k, window_strides=(1, 1), padding="SAME", dimension_numbers=numbers),
        "im2col": lambda x, k: conv_im2col(x, k, (1, 1), "SAME", (1, 1)),
    }
    if onednn.available() and onednn.supports(dtype, dtype):  # and, for bf16, oneDNN has bf16 kernels here
        impls["onednn"] = lambda x, k: onednn.conv(x, k, (1, 1), [(1, 1), (1, 1)], (1, 1))
    cases = {}
    for impl, fn in impls.items():
        fwd = jax.jit(fn)
        bwd = jax.jit(lambda x, k, g, fn=fn: jax.vjp(fn, x, k)[1](g))
        cases[(impl, "fwd")] = lambda fwd=fwd: fwd(x, k)
        cases[(impl, "bwd")] = lambda bwd=bwd: bwd(x, k, g)
    return cases


def _jax_gemm_cases(shape) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxnn import precision as prec
    from jaxnn.kernels import onednn

    m, k, n = shape
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    cases = {}
    for impl, flag in [("xla_dot", False), ("onednn", True)][: 2 if onednn.supports_bf16() else 1]:
        with onednn.use(flag):  # read while tracing: the jit calls below trace here
            fwd = jax.jit(prec.dense).lower(a, b).compile()
            bwd = jax.jit(lambda a, b, g: jax.vjp(prec.dense, a, b)[1](g)).lower(a, b, g).compile()
        cases[(impl, "fwd")] = lambda fwd=fwd: fwd(a, b)
        cases[(impl, "bwd")] = lambda bwd=bwd: bwd(a, b, g)
    return cases


def _torch_conv_cases(shape, precision: str) -> dict:
    import torch
    import torch.nn.functional as F

    n, h, w, c, f = shape
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=gen).to(dtype)
    k = torch.randn(f, c, 3, 3, generator=gen).to(dtype)
    g = torch.randn(n, f, h, w, generator=gen).to(dtype)
    # "pytorch": NCHW, as the PyTorch CNN in benchmarks/peers runs (and as PyTorch users write it);
    # "pytorch_nhwc": channels-last tensors, the layout of jaxnn and of the oneDNN kernels.
    cases = {}
    for impl, layout in (("pytorch", torch.contiguous_format), ("pytorch_nhwc", torch.channels_last)):
        xl, kl, gl = (t.contiguous(memory_format=layout) for t in (x, k, g))

        def fwd(xl=xl, kl=kl):
            F.conv2d(xl, kl, padding=1)

        def bwd(xl=xl, kl=kl, gl=gl):
            torch.ops.aten.convolution_backward(gl, xl, kl, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, MASK)

        cases[(impl, "fwd")], cases[(impl, "bwd")] = fwd, bwd
    return cases


def _torch_gemm_cases(shape) -> dict:
    import torch

    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, generator=gen).to(torch.bfloat16)
    g = torch.randn(m, n, generator=gen).to(torch.bfloat16)

    def fwd():
        torch.mm(a, b)

    def bwd():  # the backward of a @ b as autograd runs it
        torch.mm(g, b.T), torch.mm(a.T, g)

    return {("pytorch", "fwd"): fwd, ("pytorch", "bwd"): bwd}


def worker(framework: str, repeats: int) -> list[dict]:
    """Times every primitive case of `framework` ("jax" or "torch"); one row per (case, impl, pass)."""
    from jaxnn.profile.timing import time_interleaved

    if framework == "torch":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
    groups = [(f"conv {s[1]}x{s[2]}x{s[3]}->{s[4]}", p, conv_flops(*s), s, "conv") for s in CONVS for p in PRECISIONS]
    groups += [(f"gemm {m}x{k}x{n}", "bf16", 2.0 * m * k * n, (m, k, n), "gemm") for m, k, n in GEMMS]
    rows = []
    for name, precision, flops, shape, kind in groups:
        if kind == "conv":
            cases = (_jax_conv_cases if framework == "jax" else _torch_conv_cases)(shape, precision)
        else:
            cases = (_jax_gemm_cases if framework == "jax" else _torch_gemm_cases)(shape)
        timings = time_interleaved({f"{i}|{p}": fn for (i, p), fn in cases.items()}, repeats=repeats)
        for label, timing in timings.items():
            impl, pass_ = label.split("|")
            work = flops * (2 if pass_ == "bwd" else 1)
            rows.append(
                {"case": name, "precision": precision, "impl": impl, "pass": pass_, "ms": timing.median * 1e3}
                | {"gflops": work / timing.median / 1e9}
            )
        print(f"{framework}: {name} {precision} done", file=sys.stderr, flush=True)
    return rows


def ab_steps(models=("cnn", "gpt"), repeats: int = 5) -> list[dict]:
    """jaxnn's training steps on XLA's kernels only ("xla"), with this machine's defaults ("default": the kinds of
    kernel it measured faster, `jaxnn.kernels.onednn.choice`) and with every kernel ("onednn", JAXNN_ONEDNN=1),
    compiled in this process and timed side by side (interleaved windows): the A/B that load from other processes
    cannot tilt, unlike process-per-library rounds. For the CNN also "onednn_stem": the kernels on the 3-channel
    stem too (what `ONEDNN_AUTO_MIN_CHANNELS` keeps on im2col)."""
    from benchmarks.peers.peer_jaxnn import build
    from jaxnn.kernels import onednn
    from jaxnn.layers import conv
    from jaxnn.profile.timing import time_interleaved

    rows, min_channels = [], conv.ONEDNN_AUTO_MIN_CHANNELS
    for name in models:
        variants = [("xla", False, min_channels), ("default", None, min_channels), ("onednn", True, min_channels)]
        variants += [("onednn_stem", True, 1)] if name == "cnn" else []
        for precision in PRECISIONS:
            steps = {}
            for label, flag, channels in variants:
                conv.ONEDNN_AUTO_MIN_CHANNELS = channels  # read when tracing, like the switch
                with onednn.use(flag):  # compiled here, under the switch, so that no later retrace can change it
                    step = build(name, precision)
                    step.step_fn = step.step_fn.lower(step.state, step.batch).compile()
                steps[label] = step
            conv.ONEDNN_AUTO_MIN_CHANNELS = min_channels
            timings = time_interleaved(steps, repeats=repeats)
            row = {"model": name, "precision": precision} | {k: t.median * 1e3 for k, t in timings.items()}
            rows.append(row)
            print(f"A/B {name} {precision}: " + ", ".join(f"{k} {row[k]:.4g} ms" for k in steps), file=sys.stderr)
    return rows


def format_ab(rows: list[dict]) -> str:
    """The in-process A/B as text: median ms per step of each variant, and its ratio to the XLA path."""
    lines = [
        "jaxnn steps in one process, interleaved windows, median ms "
        "(xla: no kernels; default: this CPU's measured choice; onednn: JAXNN_ONEDNN=1)"
    ]
    for row in rows:
        cells = [f"{k} {v:8.4g} ({v / row['xla']:.2f}x)" for k, v in row.items() if k not in ("model", "precision")]
        lines.append(f"{row['model']:4} {row['precision']:5} " + "  ".join(cells))
    return "\n".join(lines)


def run_primitives(rounds: int, repeats: int) -> list[dict]:
    """Alternates the JAX and the PyTorch worker processes `rounds` times; every row of every round."""
    rows = []
    for r in range(rounds):
        for framework in ("jax", "torch"):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [sys.executable, "-m", "benchmarks.onednn", "--worker", framework, "--repeats", str(repeats)]
            done = subprocess.run([*cmd, "--out", out], stderr=subprocess.PIPE, text=True)
            if done.returncode:
                print(f"round {r + 1}: {framework} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
            else:
                with open(out) as f:
                    rows += [row | {"round": r} for row in json.load(f)]
            os.unlink(out)
            print(f"round {r + 1}/{rounds}: {framework} primitives done", file=sys.stderr, flush=True)
    return rows


def format_primitives(rows: list[dict]) -> str:
    """One line per (case, precision, pass): median GFLOP/s over rounds of each implementation."""
    med: dict = {}
    for row in rows:
        med.setdefault((row["case"], row["precision"], row["pass"]), {}).setdefault(row["impl"], []).append(
            row["gflops"]
        )
    impls = ["xla_conv", "im2col", "xla_dot", "onednn", "pytorch", "pytorch_nhwc"]
    lines = [f"{'primitive':26} {'prec':5} {'pass':4} " + " ".join(f"{i:>9}" for i in impls) + "  onednn/pytorch"]
    for (case, precision, pass_), by_impl in med.items():
        cells = {i: statistics.median(v) for i, v in by_impl.items()}
        ratio = cells["onednn"] / cells["pytorch"] if "onednn" in cells and "pytorch" in cells else None
        lines.append(
            f"{case:26} {precision:5} {pass_:4} "
            + " ".join(f"{cells[i]:9.1f}" if i in cells else f"{'-':>9}" for i in impls)
            + (f"  {ratio:.2f}" if ratio else "")
        )
    lines.append("GFLOP/s, median over rounds; bwd = both gradients (2x the forward's FLOPs)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.onednn", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timing windows per case and process")
    parser.add_argument("--no-steps", action="store_true", help="skip the steps against PyTorch (benchmarks.peers)")
    parser.add_argument("--no-primitives", action="store_true", help="skip the primitives")
    parser.add_argument("--no-ab", action="store_true", help="skip the in-process A/B of the jaxnn steps")
    parser.add_argument("--ab-models", nargs="+", default=["cnn", "gpt"], help="the models of the A/B")
    add_json_flags(parser, "default: results/bench/onednn-<UTC time>.json")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps_json = args.json and args.json.replace(".json", "-steps.json")  # benchmarks.peers writes it
    refuse_existing(args.json, None if args.no_steps else steps_json, overwrite=args.overwrite)
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(worker(args.worker, args.repeats), f)
        return 0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.json or os.path.join("results", "bench", f"onednn-{stamp}.json")
    result: dict = {"cpu": cpu_label(), "rounds": args.rounds, "repeats": args.repeats}
    if not args.no_primitives:
        result["primitives"] = run_primitives(args.rounds, args.repeats)
        print(format_primitives(result["primitives"]))
        print(f"measured on {cpu_label()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_ab:
        result["ab_steps"] = ab_steps(args.ab_models, repeats=args.repeats)
        print(format_ab(result["ab_steps"]))
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    if not args.no_steps:
        from benchmarks.peers.__main__ import main as peers

        steps = ["--peers", "jaxnn", "jaxnn_onednn", "pytorch", "--models", "cnn", "gpt", "--rounds", str(args.rounds)]
        replace = ["--overwrite"] if args.overwrite else []
        peers([*steps, "--repeats", str(args.repeats), "--json", path.replace(".json", "-steps.json"), *replace])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
