"""Runnable benchmarks, run from the checkout's root (`python -m benchmarks.<name>`); never imported by jaxnn.

Benchmarks are programs, so they opt in to jaxnn's host-memory settings before jax starts (`jaxnn.keep_host_memory`,
docs/performance.md): their steps are timed as the `jaxnn` command runs them. They time steps and never use the
persistent compilation cache, so XLA's scratch is split into blocks too. `JAXNN_MALLOC=0` leaves malloc alone.
"""

import jaxnn

jaxnn.keep_host_memory(split_scratch=True)
