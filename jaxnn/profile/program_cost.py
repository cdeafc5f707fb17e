"""What the accelerator model (`jaxnn.profile.projection.GpuModel`) needs of a compiled program: XLA's FLOPs and
bytes, the kernels it would launch and its loop iterations, read from the program compiled on the machine at hand.

Compiling on the CPU gives the CPU compiler's fusions, not a GPU compiler's: the kernel count is an estimate, and so
is every figure projected from it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax

from jaxnn._src.xla_cost import cost_counts
from jaxnn.profile.projection import ProgramCost

# Instructions that launch no kernel of their own on a GPU (bookkeeping, or a loop whose body is counted).
NO_KERNEL = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*)$")


def _op_of(rhs: str) -> str:
    """The opcode of an instruction's right-hand side, past its (possibly tuple) result type."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1 :]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    match = re.match(r"\s*([\w\-]+)\(", rhs)
    return match.group(1) if match else ""


def kernel_launches(hlo_text: str) -> tuple[int, int, int]:
    """(kernels, loop iterations, trip count of the outermost loop) of a compiled HLO module: every instruction
    of the entry computation that launches a kernel, and a while loop's body and condition once per iteration
    (XLA's known trip count; 1 where it is unknown). Fused computations are one kernel, their callers'."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and (instr := _INSTR.match(line)):
            comps[current].append(instr.group(1))

    def count(name: str, seen: tuple = ()) -> tuple[int, int, int]:
        kernels = trips = outer = 0
        for rhs in comps.get(name, []) if name not in seen else []:
            op = _op_of(rhs)
            if op == "while":
                n = int((re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs) or [0, 1])[1])
                parts = [count(m, (*seen, name)) for m in re.findall(r"(?:body|condition)=%?([\w.\-]+)", rhs)]
                kernels += n * sum(k for k, _, _ in parts)
                trips += n * (1 + sum(t for _, t, _ in parts))
                outer = max(outer, n)
            elif op == "call":  # XLA:CPU wraps small loops in calls; what they call runs as if inline
                for callee in re.findall(r"to_apply=%?([\w.\-]+)", rhs):
                    k, t, o = count(callee, (*seen, name))
                    kernels, trips, outer = kernels + k, trips + t, max(outer, o)
            elif op and op not in NO_KERNEL:
                kernels += 1
        return kernels, trips, outer

    if entry is None:
        return 1, 0, 1
    kernels, trips, outer = count(entry)
    return max(kernels, 1), trips, max(outer, 1)


# XLA:CPU hands chains of products, convolutions and their elementwise consumers to YNNPACK as one fused call (a
# whole small CNN became one "kernel", its activations never counted as bytes); no GPU compiler fuses across a
# convolution so. Where a program is compiled here as another platform's, each product and convolution is a call
# of its own (as cuBLAS and cuDNN calls are on a GPU) and XLA's own fusions stay.
CPU_LIBRARY_FUSIONS_APART = {
    "xla_cpu_experimental_ynn_fusion_type": ",".join(
        ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION")
    )
}


def _compile_for(traced: jax.stages.Traced, platform: str) -> jax.stages.Compiled:
    """`traced` lowered for `platform` and compiled by this process's compiler, its library calls one operation
    each (an XLA without the option fuses no chains into them either)."""
    lowered = traced.lower(lowering_platforms=(platform,))
    try:
        return lowered.compile(compiler_options=dict(CPU_LIBRARY_FUSIONS_APART))
    except Exception as err:  # jax raises XlaRuntimeError, which it does not export under one name across versions
        if "xla_cpu_experimental_ynn_fusion_type" not in str(err):
            raise
        return lowered.compile()


def program_cost(
    fn: Callable,
    args: tuple,
    kind: str,
    h2d: float = 0.0,
    d2h: float = 0.0,
    *,
    loop_is_all: bool = False,
    platform: str | None = None,
) -> ProgramCost:
    """Compiles `fn` (jitted here if it is not already) for `args` (arrays or ShapeDtypeStructs) and reads its
    cost. XLA's cost analysis counts a loop body once: `loop_is_all` scales FLOPs and bytes by the outermost trip
    count, for programs that are one loop (a chain of products, an RNN); others add their loops' work themselves.

    `platform` ("cuda"): lower the program as for that platform, then compile it here. jaxnn's layers pick their
    lowering by the platform lowered for (`lax.platform_dependent`): lowered for the CPU, a convolution is im2col's
    patches or a oneDNN kernel, whichever this CPU measured faster, and its bytes are those of that lowering;
    lowered for a GPU it is XLA's convolution, one operation reading its input and weights and writing its output,
    as a GPU runs it, whatever CPU compiles it; and no CPU library call fuses several operations
    (`CPU_LIBRARY_FUSIONS_APART`). None: the platform of this process's default backend, compiled as it runs here."""
    traced = jax.jit(fn).trace(*args)
    compiled = _compile_for(traced, platform) if platform else traced.lower().compile()
    flops, nbytes = cost_counts(compiled)
    kernels, trips, outer = kernel_launches(compiled.as_text() or "")
    scale = outer if loop_is_all else 1
    return ProgramCost((flops or 0.0) * scale, (nbytes or 0.0) * scale, kind, kernels, trips, h2d, d2h)
