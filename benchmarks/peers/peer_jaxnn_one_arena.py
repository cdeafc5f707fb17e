"""jaxnn's "jaxnn" row with every thread on glibc's main arena (JAXNN_MALLOC=one-arena), which keeps the memory
XLA's scratch takes in one place instead of in each worker thread's arena, at the cost of one lock for every thread
(jaxnn/_src/malloc.py)."""

from __future__ import annotations

import os
import sys

os.environ["JAXNN_MALLOC"] = "one-arena"  # read when jaxnn is imported, below

from benchmarks.peers.common import main  # noqa: E402 (after the switch)
from benchmarks.peers.peer_jaxnn import build, kernels  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("jaxnn_one_arena", build, describe=kernels))
