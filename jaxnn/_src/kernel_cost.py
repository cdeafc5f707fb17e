"""FLOPs and bytes of jaxnn's oneDNN kernels in a program, from their operand shapes, for XLA's cost analysis
(`xla_cost.cost_counts` adds them; `jaxnn.profile.kernel_cost` is their public name).

XLA cannot see into a custom call: its cost analysis counts each one as -1 FLOPs and -1 bytes ("unknown") and adds
that to the program's totals, so a convolution on oneDNN counted nothing. `kernel_costs` reads the custom calls of
jaxnn's kernels from the program's HLO text and counts each from its operand shapes, as the same operation on
XLA's CPU kernels counts, so that a program's FLOPs say what the model computes, whichever kernel runs it.

Why from the HLO and not by lowering the program again with the kernels off: the counts are wanted of programs
already compiled (a train step, a layer being timed), a second compilation would double the cost of a count, and a
program traced again could differ in more than its kernels.

A convolution counts 2*N*Ho*Wo*Kh*Kw*Cin*Cout (2 FLOPs per multiply-add, over every kernel tap), as the CPU's
other lowering of it counts (im2col: one product over the padded input's taps); its two gradients count as much,
each multiplying the same (output, tap) pairs. (XLA's own count of a `lax.conv_general_dilated`, the lowering on other
platforms, leaves out the taps that fall on the zero padding.) A product counts 2*M*N*K.
"""

from __future__ import annotations

import math
import re

# An HLO instruction's name and array type, e.g. `%ffi_call.2 = f32[2,32,32,3]{3,2,1,0} custom-call(...)`; a
# compiled program's text writes names with a `%`, a lowered one's without.
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[([\d,]*)\]", re.M)
_CALL = re.compile(r"custom-call\(([^)]*)\).*?custom_call_target=\"(\w+)\"")
_ATTRIBUTE = re.compile(r"(\w+) = (-?\d+) : i64")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "f64": 8, "s64": 8}
# The FFI targets of `jaxnn.kernels.onednn.library.TARGETS`, named here rather than imported: `_src` sits below the
# kernels' package (which imports `_src`), and rooms import each other one way only.
KERNELS = {
    "jaxnn_onednn_conv_fwd": "conv_fwd",
    "jaxnn_onednn_conv_bwd_data": "conv_bwd_data",
    "jaxnn_onednn_conv_bwd_weights": "conv_bwd_weights",
    "jaxnn_onednn_matmul": "matmul",
}

Array = tuple[str, tuple[int, ...]]


def kernel_costs(hlo_text: str) -> tuple[float, float, int]:
    """(FLOPs, bytes read and written, number of calls) of the oneDNN kernel calls in a program's HLO text; each
    instruction once, as XLA's cost analysis counts a loop body once."""
    arrays = {name: (dtype, _dims(dims)) for name, dtype, dims in _DEFINITION.findall(hlo_text)}
    flops = nbytes = 0.0
    calls = 0
    for line in hlo_text.splitlines():
        call = _CALL.search(line)
        kernel = KERNELS.get(call.group(2)) if call else None
        definition = _DEFINITION.search(line)
        if call is None or kernel is None or definition is None:
            continue
        out = arrays[definition.group(1)]
        # An operand is its name, or (in some printings) its type and then its name.
        operands = [arrays[o.split()[-1].lstrip("%")] for o in call.group(1).split(", ")]
        flops += _flops(kernel, out, operands, _attributes(line))
        nbytes += sum(_nbytes(array) for array in (out, *operands))
        calls += 1
    return flops, nbytes, calls


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _nbytes(array: Array) -> int:
    dtype, dims = array
    return _ITEMSIZE.get(dtype, 4) * math.prod(dims)


def _attributes(line: str) -> dict[str, int]:
    """The kernel's integer attributes in `backend_config` (a product's `trans_a`)."""
    return {name: int(value) for name, value in _ATTRIBUTE.findall(line.partition("backend_config=")[2])}


def _flops(kernel: str, out: Array, operands: list[Array], attrs: dict[str, int]) -> float:
    if kernel == "matmul":
        a = operands[0][1]
        contracted = a[-2] if attrs.get("trans_a") else a[-1]
        return 2.0 * math.prod(out[1]) * contracted
    # The weights (*kernel, Cin, Cout) and the output (or its gradient: N, *out_spatial, Cout) of each kernel.
    w, y = {
        "conv_fwd": (operands[1], out),
        "conv_bwd_data": (operands[1], operands[0]),
        "conv_bwd_weights": (out, operands[1]),
    }[kernel]
    return 2.0 * math.prod(y[1]) * math.prod(w[1][:-1])
