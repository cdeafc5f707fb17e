"""Claim 3 (tensor cores) and 4 (libraries): matmul and convolution throughput per precision, with accuracy.

Modes: exact fp32 (`precision=HIGHEST`), TF32-class (`precision=HIGH`: TF32 tensor cores on a GPU, exact fp32 on a
CPU), bf16 and fp16 operands accumulated in fp32 (the tensor-core / AMX form), and bf16 operands with a bf16 result
(`x @ y` on bf16 arrays, which XLA's CPU runs on a slower path). Each result's relative error is taken against a
float64 reference computed with numpy on a slice of the output; the speedup is over exact fp32 in the same run. The
library kernels XLA chose (custom calls and library fusions in the compiled HLO) are recorded for claim 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import common
from jaxnn import precision as jaxnn_precision
from jaxnn.profile.timing import time_interleaved

NAME = "exp_precision"

# (operand dtype, lax precision, preferred element type)
# In the order they run: a budget that runs out skips from the end, so fp32 (every speed-up's baseline) and bf16
# (the claim) come first.
MODES = {
    "fp32": (jnp.float32, lax.Precision.HIGHEST, jnp.float32),
    "bf16": (jnp.bfloat16, None, jnp.float32),
    "bf16_out": (jnp.bfloat16, None, None),
    "fp16": (jnp.float16, None, jnp.float32),
    "tf32": (jnp.float32, lax.Precision.HIGH, jnp.float32),
}
MATMUL_N = {"tiny": 64, "quick": 1024, "full": 2048, "gpu": 8192}
# (batch, height/width, in channels, out channels) of a 3x3 SAME convolution.
CONV = {"tiny": (2, 8, 8, 8), "quick": (8, 32, 64, 64), "full": (16, 32, 128, 128), "gpu": (128, 56, 256, 256)}
REF_ROWS = 256  # output rows (matmul) checked against float64: enough for a stable norm, cheap on any host


def _matmul(precision, preferred):
    return jax.jit(
        lambda a, b: lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred
        )
    )


def _conv(precision, preferred):
    kwargs = {"window_strides": (1, 1), "padding": "SAME", "dimension_numbers": ("NHWC", "HWIO", "NHWC")}

    def conv(x, w):
        if preferred is not None and x.dtype in (jnp.bfloat16, jnp.float16):
            # The form jaxnn trains with: on GPUs a half-precision result cast to f32, since XLA's GPU compiler
            # upcasts the operands of a convolution asked for a wider result (an f32 cuDNN convolution).
            return jaxnn_precision.conv(x, w, **kwargs)
        return lax.conv_general_dilated(x, w, precision=precision, preferred_element_type=preferred, **kwargs)

    return jax.jit(conv)


def conv_reference(x, w) -> np.ndarray:
    """A 3x3 stride-1 SAME convolution (NHWC, HWIO) in float64 by im2col; exact enough to judge fp32."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    kh, kw, cin, cout = w.shape
    ph, pw = kh // 2, kw // 2
    xp = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    b, h, wd, _ = x.shape
    cols = np.stack([xp[:, i : i + h, j : j + wd, :] for i in range(kh) for j in range(kw)], axis=3)  # B,H,W,9,C
    return cols.reshape(b, h, wd, kh * kw * cin) @ w.reshape(kh * kw * cin, cout)


def run(size: str = "quick", budget: common.Budget | None = None) -> dict:
    """Throughput, relative error and library kernels of each precision mode, for a matmul and a convolution."""
    budget = budget or common.Budget(None)
    repeats = 3 if size == "tiny" else 5
    device = jax.devices()[0]
    n = common.preset(MATMUL_N, size)
    batch, hw, cin, cout = common.preset(CONV, size)
    rng = np.random.default_rng(0)
    a64 = rng.standard_normal((n, n))
    b64 = rng.standard_normal((n, n))
    x64 = rng.standard_normal((batch, hw, hw, cin))
    w64 = rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin)
    rows = min(REF_ROWS, n)
    mm_ref = a64[:rows] @ b64
    conv_ref = conv_reference(x64[:1], w64)
    problems = {
        "matmul": (_matmul, (a64, b64), 2.0 * n**3, lambda out: (out[:rows], mm_ref), {"m": n, "k": n, "n": n}),
        "conv": (
            _conv,
            (x64, w64),
            2.0 * batch * hw * hw * cin * cout * 9,
            lambda out: (out[:1], conv_ref),
            {"batch": batch, "hw": hw, "cin": cin, "cout": cout, "kernel": 3},
        ),
    }
    results = []
    for op, (builder, inputs, flops, compare, shape) in problems.items():
        built = {}
        for mode, (dtype, precision, preferred) in MODES.items():
            if budget.over(0.9):
                budget.skip(f"{op} {mode}")
                continue
            args = [jax.device_put(jnp.asarray(v, jnp.float32).astype(dtype), device) for v in inputs]
            fn = builder(precision, preferred)
            built[mode] = (fn, args, np.asarray(fn(*args).astype(jnp.float32)))
        # Side by side (every timing window runs every mode in turn): timed one after the other, a burst of load
        # or the first mode's warm-up landed on one mode only (fp32 and tf32, the same op on a CPU, once measured
        # 1.7x apart).
        timings = time_interleaved(
            {mode: (lambda fn=fn, args=args: fn(*args)) for mode, (fn, args, _) in built.items()}, repeats=repeats
        )
        for mode, (fn, args, out) in built.items():
            timing = timings[mode]
            results.append(
                {
                    "op": op,
                    "mode": mode,
                    **shape,
                    **timing.as_dict(),
                    "flops": flops,
                    "gflops": flops / timing.median / 1e9,
                    "rel_error": common.relative_error(*compare(out)),
                    "kernels": common.library_calls(common.compiled_hlo(fn, *args)),
                }
            )
    for op in problems:
        base = next((r for r in results if r["op"] == op and r["mode"] == "fp32"), None)
        for r in results:
            if base and r["op"] == op:
                r["speedup_vs_fp32"] = base["median"] / r["median"]
    return {"rows": results, "device_kind": device.device_kind}


def summary(record: dict) -> dict:
    """Speedup over exact fp32 and relative error, per op and mode; the fastest reduced-precision mode per op."""
    out = {}
    for r in record["rows"]:
        out.setdefault(r["op"], {})[r["mode"]] = {
            "gflops": r["gflops"],
            "speedup": r.get("speedup_vs_fp32"),
            "rel_error": r["rel_error"],
            "kernels": sorted({k["target"] for k in r["kernels"]}),
        }
    return out


def plot(record: dict, path) -> None:
    plt = common.pyplot()
    ops = sorted({r["op"] for r in record["rows"]})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * max(len(ops), 1), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in record["rows"] if r["op"] == op]
        modes = [r["mode"] for r in rows]
        ax.bar(modes, [r["gflops"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            err = r["rel_error"]
            ax.annotate(
                f"{r.get('speedup_vs_fp32') or 0:.2f}x\nerr {err:.1e}" if err is not None else "err inf",
                (i, r["gflops"]),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set(ylabel="GFLOP/s", title=f"{op} — {record['machine']['tag']}")
        ax.margins(y=0.25)
    common.save_figure(fig, path)


def summarize(record: dict) -> list[str]:
    return [
        f"{r['op']:6s} {r['mode']:8s} {r['gflops']:10.1f} GFLOP/s  x{r.get('speedup_vs_fp32') or 0:.2f} vs fp32  "
        f"rel err {r['rel_error'] if r['rel_error'] is not None else float('inf'):.1e}"
        for r in record["rows"]
    ]


if __name__ == "__main__":
    common.main(NAME, run, plot, summarize)
