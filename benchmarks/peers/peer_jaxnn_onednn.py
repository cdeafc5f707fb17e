"""jaxnn's "jaxnn" row with every oneDNN kernel switched on (JAXNN_ONEDNN=1): Conv(lowering="auto") and the
products of `jaxnn.precision.einsum` run on oneDNN. Fails, with the reason, where they are not built;
its bf16 rows fail where oneDNN has no bfloat16 kernels for this CPU (they would time XLA's kernels instead)."""

from __future__ import annotations

import os
import sys

from benchmarks.peers.common import main
from benchmarks.peers.peer_jaxnn import build, kernels
from jaxnn.kernels import onednn
from jaxnn.kernels.onednn.library import ENV_SWITCH


def build_with_kernels(model: str, precision: str):
    if precision == "bf16" and not onednn.supports_bf16():
        raise RuntimeError(f"oneDNN {onednn.version()} has no bfloat16 kernels for this CPU")
    return build(model, precision)


if __name__ == "__main__":
    if not onednn.available():
        sys.exit(f"jaxnn_onednn: {onednn.unavailable_reason()}")
    os.environ[ENV_SWITCH] = "1"  # read when each step is traced
    sys.exit(main("jaxnn_onednn", build_with_kernels, describe=kernels))
