"""jaxnn keeps the memory of XLA's CPU programs mapped between runs (jaxnn/_src/malloc.py): where jaxnn is imported
before jax starts, a program with a large scratch buffer stops faulting its pages in afresh on every call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxnn._src import malloc

# A program whose scratch buffer (a 64 MB product) is too large for a thread's malloc arena; reports the minor page
# faults of its later calls.
_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import jaxnn
    import jax, jax.numpy as jnp
    from jaxnn._src import malloc

    @jax.jit
    def f(a):
        y = a @ a.T
        return jnp.tanh(y).sum(0) + y.max(1)

    a = jnp.ones((4096, 8))
    for _ in range(3):
        f(a).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        f(a).block_until_ready()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(malloc.status())
    print((after - before) / 5)
    """
)


def _run(code: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAXNN_MALLOC", "JAX_PLATFORMS")}
    environ.update(env, XLA_FLAGS="", JAX_NUM_CPU_DEVICES="1")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc.platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)


@needs_glibc
def test_a_large_program_stops_faulting_its_scratch_memory_in_on_every_call():
    kept_status, kept = _run(_FAULTS, JAX_PLATFORMS="cpu")
    left_status, left = _run(_FAULTS, JAX_PLATFORMS="cpu", JAXNN_MALLOC="0")
    assert kept_status.startswith("kept between runs"), kept_status
    assert left_status == "left as it is (JAXNN_MALLOC=0)"
    # Untouched, each call maps its 64 MB scratch buffer afresh: thousands of 4 KiB pages.
    assert float(left) > 4000, left
    assert float(kept) < float(left) / 20, (kept, left)


def test_it_is_left_alone_once_jax_has_started_and_where_an_accelerator_is_configured():
    started = "import jax; jax.numpy.ones(1).block_until_ready()\nimport jaxnn\nfrom jaxnn._src import malloc\n"
    (line,) = _run(started + "print(malloc.status())", JAX_PLATFORMS="cpu")
    assert line == "left as it is (jax had started before jaxnn was imported)"
    (line,) = _run("import jaxnn\nfrom jaxnn._src import malloc\nprint(malloc.status())", JAX_PLATFORMS="cuda,cpu")
    assert line == "left as it is (an accelerator platform is configured or installed)"


def test_an_installed_accelerator_plugin_counts_as_configured(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(malloc.sys, "modules", {k: v for k, v in sys.modules.items() if k != "jax"})
    monkeypatch.setattr(malloc.importlib.metadata, "entry_points", lambda group: ["xla_cuda13"])
    assert malloc._accelerator_present()
    monkeypatch.setattr(malloc.importlib.metadata, "entry_points", lambda group: [])
    assert not malloc._accelerator_present()
