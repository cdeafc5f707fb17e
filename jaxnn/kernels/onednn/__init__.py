"""oneDNN kernels for the CPU through XLA's FFI: direct convolutions (forward, backward data, backward weights;
channels last, float32 and bfloat16) and matrix products (float32, and bfloat16 with float32 accumulation), usable
under jit, grad, vmap and shard_map.

Optional (`pip install 'jaxnn[onednn]'`, then `make install` compiles them); `available()` says whether they are
built here and `unavailable_reason()` why not; `supports_bf16()` whether oneDNN has bfloat16 kernels for this CPU
(AVX-512 or AVX2-VNNI-2). `Conv(lowering="onednn")` asks for them explicitly; with `lowering="auto"` and in
`jaxnn.precision.einsum` they are used where `enabled(kind, dtype)`: by default each kind (convolutions, products;
float32 and bfloat16 apart) where it measured faster than XLA's kernels on this CPU (`choice`, once per machine),
JAXNN_ONEDNN=1/0 or `use(flag)` for all of them. XLA's kernels stay the path on every other platform and wherever
the kernels (or, for bfloat16, their bf16 kernels) are absent.
"""

from jaxnn.kernels.onednn.conv import conv, supports
from jaxnn.kernels.onednn.library import (
    available,
    enabled,
    forced,
    library_path,
    supports_bf16,
    unavailable_reason,
    use,
    version,
)
from jaxnn.kernels.onednn.matmul import einsum, matmul

__all__ = [
    "available",
    "conv",
    "einsum",
    "enabled",
    "forced",
    "library_path",
    "matmul",
    "supports",
    "supports_bf16",
    "unavailable_reason",
    "use",
    "version",
]
