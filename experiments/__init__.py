"""The experiments (`python -m experiments.<name>`, `make experiments`); never imported by jaxnn.

Experiments are programs, so they opt in to jaxnn's host-memory settings before jax starts (`jaxnn.keep_host_memory`,
docs/performance.md). They time programs and never use the persistent compilation cache, so XLA's scratch is split
into blocks too. `JAXNN_MALLOC=0` leaves malloc alone.
"""

import jaxnn

jaxnn.keep_host_memory(split_scratch=True)
