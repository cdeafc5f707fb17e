"""Claim 2 (latency): a chain of small dependent steps against one parallel product of equal FLOPs, per backend.

Two chains, each a `lax.scan` of S steps that cannot run in parallel because step t+1 needs step t's result:
`chain` (h <- tanh(W h), a tiny matrix-vector product per step) and `rnn` (h <- tanh(W h + U x_t + b), an Elman RNN
with a small hidden state). Each is compared with one product of the same FLOPs that has all the parallelism
(S rows at once). Time per step shows where dependent work is cheaper: a step on a GPU costs at least a kernel
launch, a step on a CPU core costs nanoseconds to microseconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from experiments import common
from jaxnn.profile.timing import time_fn

NAME = "exp_sequential"

HIDDEN = {"tiny": [8], "quick": [16, 64, 256], "full": [16, 64, 256, 1024], "gpu": [16, 64, 256, 1024]}
STEPS = {"tiny": 16, "quick": 2000, "full": 10000, "gpu": 10000}


def make_chain(steps: int):
    def chain(w, h0):
        return lax.scan(lambda h, _: (jnp.tanh(w @ h), None), h0, None, length=steps)[0]

    return jax.jit(chain)


def make_rnn():
    def rnn(w, u, b, h0, xs_SH):
        return lax.scan(lambda h, x: (jnp.tanh(w @ h + u @ x + b), None), h0, xs_SH)[0]

    return jax.jit(rnn)


def make_parallel():
    return jax.jit(lambda x, w: jnp.tanh(x @ w))


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Sequential chain and RNN against an equal-FLOP parallel product, for each hidden size and backend."""
    budget = budget or common.Budget(None)
    repeats = 3 if size == "tiny" else 5
    steps = common.preset(STEPS, size)
    rows = []
    hiddens = {b: common.preset(HIDDEN, size) for b in common.backends_present()}
    for hidden, backend in common.interleaved(hiddens):
        device = common.first_device(backend)
        if budget.over(0.85):
            budget.skip(f"{backend} H={hidden}")
            continue
        keys = jax.random.split(jax.random.key(hidden), 5)
        scale = 1.0 / hidden**0.5
        put = lambda x: jax.device_put(x, device)  # noqa: E731
        w = put(jax.random.normal(keys[0], (hidden, hidden)) * scale)
        u = put(jax.random.normal(keys[1], (hidden, hidden)) * scale)
        b = put(jnp.zeros((hidden,)))
        h0 = put(jax.random.normal(keys[2], (hidden,)))
        xs = put(jax.random.normal(keys[3], (steps, hidden)))
        x2 = put(jax.random.normal(keys[4], (steps, 2 * hidden)))
        w2 = put(jnp.concatenate([w, u], axis=1).T)
        chain, rnn, parallel = make_chain(steps), make_rnn(), make_parallel()
        cases = {
            "chain": (lambda: chain(w, h0), 2.0 * steps * hidden**2),
            "chain_parallel": (lambda: parallel(xs, w), 2.0 * steps * hidden**2),
            "rnn": (lambda: rnn(w, u, b, h0, xs), 4.0 * steps * hidden**2),
            "rnn_parallel": (lambda: parallel(x2, w2), 4.0 * steps * hidden**2),
        }
        for case, (fn, flops) in cases.items():
            timing = time_fn(fn, repeats=repeats)
            rows.append(
                {
                    "backend": backend,
                    "case": case,
                    "hidden": hidden,
                    "steps": steps,
                    **timing.as_dict(),
                    "us_per_step": timing.median / steps * 1e6,
                    "gflops": flops / timing.median / 1e9,
                }
            )
    return {"rows": rows}


def summary(record: dict) -> dict:
    """Per backend and hidden size: µs per dependent step and how much slower the chain is than its parallel twin;
    with two backends, which one runs each chain faster."""
    by = {(r["backend"], r["case"], r["hidden"]): r for r in record["rows"]}
    out = {"per_step_us": {}, "sequential_penalty": {}, "winner": {}}
    for (backend, case, hidden), r in by.items():
        if case in ("chain", "rnn"):
            out["per_step_us"].setdefault(backend, {}).setdefault(case, {})[hidden] = r["us_per_step"]
            twin = by.get((backend, case + "_parallel", hidden))
            if twin:
                penalty = out["sequential_penalty"].setdefault(backend, {}).setdefault(case, {})
                penalty[hidden] = r["median"] / twin["median"]
    backends = sorted({r["backend"] for r in record["rows"]})
    accel = [b for b in backends if b != "cpu"]
    if accel and "cpu" in backends:
        for (backend, case, hidden), r in by.items():
            if backend == accel[0] and case in ("chain", "rnn") and ("cpu", case, hidden) in by:
                cpu = by[("cpu", case, hidden)]["median"]
                out["winner"].setdefault(case, {})[hidden] = {
                    "winner": "cpu" if cpu < r["median"] else accel[0],
                    "cpu_over_accel": cpu / r["median"],
                }
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for backend in sorted({r["backend"] for r in record["rows"]}):
        for case, style in (("chain", "-o"), ("rnn", "-s"), ("chain_parallel", ":o"), ("rnn_parallel", ":s")):
            rows = sorted(
                (r for r in record["rows"] if r["backend"] == backend and r["case"] == case), key=lambda r: r["hidden"]
            )
            if rows:
                axes[0].plot(
                    [r["hidden"] for r in rows], [r["median"] * 1e3 for r in rows], style, label=f"{backend} {case}"
                )
                if not case.endswith("parallel"):
                    axes[1].plot(
                        [r["hidden"] for r in rows], [r["us_per_step"] for r in rows], style, label=f"{backend} {case}"
                    )
    steps = record["rows"][0]["steps"] if record["rows"] else 0
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="hidden size",
        ylabel="ms per call",
        title=f"{steps} dependent steps vs one product",
    )
    axes[1].set(
        xscale="log", yscale="log", xlabel="hidden size", ylabel="µs per dependent step", title=record["machine"]["tag"]
    )
    for ax in axes:
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    s = summary(record)
    lines = []
    for backend, cases in s["per_step_us"].items():
        for case, per_h in cases.items():
            pen = s["sequential_penalty"].get(backend, {}).get(case, {})
            lines.append(
                f"{backend} {case}: "
                + ", ".join(
                    f"H={h}: {us:.2f} µs/step ({pen.get(h, float('nan')):.1f}x its parallel twin)"
                    for h, us in per_h.items()
                )
            )
    for case, per_h in s["winner"].items():
        lines.append(f"{case} winner: " + ", ".join(f"H={h}: {v['winner']}" for h, v in per_h.items()))
    return lines


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
