"""jaxnn's "jaxnn" row with glibc's malloc and XLA's flags left as they are (JAXNN_MALLOC=0): every step maps and
zeroes XLA's scratch buffer afresh, as jaxnn did before it kept that memory between steps (jaxnn/_src/malloc.py)."""

from __future__ import annotations

import os
import sys

os.environ["JAXNN_MALLOC"] = "0"  # read when jaxnn is imported, below

from benchmarks.peers.common import main  # noqa: E402 (after the switch)
from benchmarks.peers.peer_jaxnn import build, kernels  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("jaxnn_system_malloc", build, describe=kernels))
