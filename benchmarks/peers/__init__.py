"""The benchmark models of `benchmarks.train_steps.SPECS` written in other libraries, one module per peer
(`make bench-peers`).

Each module defines `build(name, precision) -> step` where `step()` runs one Adam training step on the fixed batch
of `benchmarks.train_steps.synthetic_batch(name)` and returns something to wait on; `common.main` times it with
`jaxnn.profile.timing.time_fn`, exactly as jaxnn is timed. Peers are benchmarks only, never runtime dependencies.
"""
