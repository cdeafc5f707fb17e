"""jaxnn's "jaxnn" row on XLA's kernels only (JAXNN_ONEDNN=0): what jaxnn ran before its defaults took the oneDNN
kernels a CPU measures faster, and what it runs where they are not built."""

from __future__ import annotations

import os
import sys

from benchmarks.peers.common import main
from benchmarks.peers.peer_jaxnn import build, kernels
from jaxnn.kernels.onednn.library import ENV_SWITCH

if __name__ == "__main__":
    os.environ[ENV_SWITCH] = "0"  # read when each step is traced
    sys.exit(main("jaxnn_xla", build, describe=kernels))
