"""jaxnn's default train step (accuracy or bits per token, and the gradient norm, returned every step)."""

from __future__ import annotations

import functools
import sys

from benchmarks.peers.common import main
from benchmarks.peers.peer_jaxnn import build

if __name__ == "__main__":
    sys.exit(main("jaxnn_metrics", functools.partial(build, metrics=True)))
