"""`import jaxnn` leaves the process alone: a fresh process that imports jaxnn and uses a layer ends with the same
environment, jax configuration, logging set-up, warning filters, unraisable hook and malloc behaviour as one that
only imports jax and computes the same thing. Host-memory settings are a program's own choice
(`jaxnn.keep_host_memory()`, or `JAXNN_MALLOC=1`), made by the `jaxnn` command."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

# Prints one JSON object: what a process looks like after `argv[1]` ("jax" or "jaxnn") was imported and used.
_SNAPSHOT = textwrap.dedent(
    """
    import ctypes, json, logging, os, platform, resource, sys, warnings
    if sys.argv[1] == "jaxnn":
        import jaxnn
        from jaxnn import layers as L
        import jax, jax.numpy as jnp
        layer = L.serial(L.Dense(8), L.Relu, L.Dense(3))
        _, params = layer.init(jax.random.key(0), (2, 4))
        loss = lambda p: layer.apply(p, jnp.ones((2, 4))).sum()
        jax.block_until_ready(jax.jit(jax.grad(loss))(params))
    else:
        import jax, jax.numpy as jnp
        jax.block_until_ready(jnp.ones((2, 4)) @ jnp.ones((4, 3)))

    def faults_of_a_48mb_round_trip():
        # glibc left as it is maps a 48 MB block afresh each time (12,288 pages); jaxnn's settings would reuse it.
        if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
            return None
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            block = libc.malloc(48 * 2**20)
            ctypes.memset(block, 1, 48 * 2**20)
            libc.free(block)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3 > 10000

    loggers = ("", "jax", "jaxlib", "absl", "asyncio", "orbax")
    print(json.dumps({
        "environ": dict(os.environ),
        "jax_config": {k: repr(v) for k, v in jax.config.values.items()},
        "log_levels": {name: logging.getLogger(name).level for name in loggers},
        "log_filters": {name: len(logging.getLogger(name).filters) for name in loggers},
        "log_handlers": {name: len(logging.getLogger(name).handlers) for name in loggers},
        "warning_filters": [repr(f) for f in warnings.filters],
        "unraisablehook_untouched": sys.unraisablehook is sys.__unraisablehook__,
        "malloc_maps_afresh": faults_of_a_48mb_round_trip(),
    }))
    """
)


def _snapshot(what: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXNN_", "XLA_FLAGS", "TF_CPP"))}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-c", _SNAPSHOT, what]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.system  # starts processes
def test_importing_jaxnn_and_using_a_layer_changes_nothing_process_wide():
    plain, with_jaxnn = _snapshot("jax"), _snapshot("jaxnn")
    for key in plain:
        assert with_jaxnn[key] == plain[key], key
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert with_jaxnn["malloc_maps_afresh"] is True


@pytest.mark.system  # starts processes
def test_the_program_opts_in_with_one_call_or_the_environment():
    code = "import jaxnn, os; print(jaxnn.keep_host_memory(split_scratch=True)); print(os.environ['XLA_FLAGS'])"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXNN_", "XLA_FLAGS"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    status, flags = out.stdout.strip().splitlines()
    if platform.libc_ver()[0] == "glibc":
        assert status.startswith("kept between runs (scratch in blocks of at most 48 MB"), status
        assert flags == "--xla_multiheap_size_constraint_per_heap=50331648"
    code = "import os, jaxnn; print(os.environ.get('XLA_FLAGS', ''))"
    for mode, split in (("1", False), ("0", False)):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "JAX_PLATFORMS": "cpu", "JAXNN_MALLOC": mode},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert ("multiheap" in out.stdout) == split  # the environment's opt-in keeps the compilation cache usable
