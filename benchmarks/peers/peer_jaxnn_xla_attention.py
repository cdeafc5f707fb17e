"""jaxnn's "jaxnn" row with the GPT's attention on jax's XLA path (`attention_implementation="xla"`), in both
precisions: for float32, what the GPT ran on the CPU before "auto" took the blocked path there
(`jaxnn.layers.blocked_attention`); for bf16 "auto" was and is the f32-accumulating path. The other models have
no attention: their rows are the "jaxnn" rows again, in a process of their own."""

from __future__ import annotations

import functools
import sys

from benchmarks.peers.common import main
from benchmarks.peers.peer_jaxnn import build

if __name__ == "__main__":
    sys.exit(main("jaxnn_xla_attention", functools.partial(build, attention_implementation="xla")))
