"""Test settings: 8 simulated CPU devices (for the sharding tests), strict rank promotion, a fixed key."""

import os

# Tests compile afresh: no test reads programs another run (or another xdist worker) wrote to the user's cache;
# tests/test_compile_cache.py points the cache at its own directory.
os.environ["JAXNN_COMPILE_CACHE"] = "off"

# Must happen before jax initialises its backends.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Start the backend now, so that no test (e.g. an in-process CLI call asking for its own device count) can change
# the session's device count by being the first to touch jax.
assert jax.device_count() == 8, jax.devices()


@pytest.fixture
def key():
    return jax.random.key(0)
