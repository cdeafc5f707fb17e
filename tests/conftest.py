"""Test settings: 8 simulated CPU devices (for the sharding tests), strict rank promotion, a fixed key."""

import atexit
import os
import pathlib
import shutil
import tempfile

# No test reads programs another run wrote to the user's cache (~/.cache/jaxnn/xla); tests/system/test_compile_cache.py
# points the cache at its own directory.
os.environ["JAXNN_COMPILE_CACHE"] = "off"
# One compilation cache for this session instead, shared by the xdist workers and the processes tests start (they
# inherit the environment): the suite compiles the same small models many times over, in different processes, and
# a cache hit costs milliseconds. A fresh directory per session, removed by the process that made it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxnn-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")  # only what is worth a disk entry
# A size limit is what makes jax lock the cache directory around each read and write; without one, a worker can
# read an entry another process is still writing (jax then warns and compiles again).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

# The oneDNN kernels run where a test asks for them (`onednn.use`): by default jaxnn would take the ones it measured
# faster on this CPU (`jaxnn.kernels.onednn.choice`), and the tests that read lowered programs expect XLA's ops.
os.environ.setdefault("JAXNN_ONEDNN", "0")
# Must happen before jax initialises its backends. The tests check values, never speed, and most of their time is
# XLA compiling small programs once: LLVM's optimisation level 0 halves that time (tests/test_layers.py: 78 -> 38 s
# on 2 cores; docs/testing.md) and leaves XLA's HLO passes, which the lowering tests read, as they are. Processes
# the tests start inherit the flags; benchmarks and experiments run outside the tests with XLA's defaults.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Start the backend now, so that no test (e.g. an in-process CLI call asking for its own device count) can change
# the session's device count by being the first to touch jax.
assert jax.device_count() == 8, jax.devices()


def pytest_configure(config):
    # Every fit of a test trains on fewer than the 8 simulated devices; the warning that says so once per process
    # is tested on its own (tests/test_bad_settings.py), not met at random by whichever test runs first.
    config.addinivalue_line("filterwarnings", "ignore::jaxnn.errors.UnusedDevicesWarning")


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture(autouse=True, scope="session")
def bf16_products_in_their_bf16_form():
    """Every test lowers bf16 products as for a CPU with bf16 instructions (bf16 x bf16 -> f32), whatever CPU runs
    the tests: the lowering tests read that form. On a CPU without them jaxnn widens the products to float32
    (`jaxnn._src.widened_products`), which tests/test_widened_products.py checks by switching this off."""
    from jaxnn._src import widened_products

    with pytest.MonkeyPatch.context() as patch:  # session-wide: module-scoped fixtures lower programs too
        patch.setattr(widened_products, "host_bf16_products", lambda: True)
        yield


# ----------------------------------------------------------------------------------------------------------- tiers
# `make test` is the fast tier, `-m "not slow and not system"`; `make test-all` runs everything (docs/testing.md).
FAST_TIER = "not slow and not system"
SYSTEM_DIR = pathlib.Path(__file__).parent / "system"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SYSTEM_DIR in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.system)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("markexpr", "") == FAST_TIER:
        terminalreporter.write_line(
            f"fast tier ran (-m '{FAST_TIER}'); the slow and system tiers: `make test-all`, or "
            "`pytest -m 'slow or system' tests`"
        )
