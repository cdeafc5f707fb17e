"""Runnable benchmarks, run from the checkout's root (`python -m benchmarks.<name>`); never imported by jaxnn."""
