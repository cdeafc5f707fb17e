"""jaxnn keeps the memory of XLA's CPU programs mapped between runs (jaxnn/_src/malloc.py): where jaxnn is imported
before jax starts, a program with a large scratch buffer stops faulting its pages in afresh on every call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxnn._src import malloc

# Allocates, writes and frees a 48 MB block with malloc again and again and reports the status of jaxnn's malloc
# settings and the minor page faults per round after the first few. 48 MB is above the largest size glibc's own
# threshold ever keeps instead of mapping (32 MB), the case of XLA's scratch buffers that matters. (Not numpy: it
# asks for huge pages for its large buffers itself.)
_FAULTS = textwrap.dedent(
    """
    import ctypes, resource
    import jaxnn
    from jaxnn._src import malloc

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 48 * 2**20

    def round_trip():
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)

    for _ in range(3):
        round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        round_trip()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(malloc.status())
    print((after - before) / 5)
    """
)


def _run(code: str, *args: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAXNN_MALLOC", "JAX_PLATFORMS")}
    environ.update(env, XLA_FLAGS="", JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, "-c", code, *args]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc.platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)


@needs_glibc
def test_freed_memory_is_reused_instead_of_mapped_and_faulted_in_afresh():
    kept_status, kept = _run(_FAULTS, JAX_PLATFORMS="cpu")
    left_status, left = _run(_FAULTS, JAX_PLATFORMS="cpu", JAXNN_MALLOC="0")
    assert kept_status == "kept between runs (no mmap, trimmed after each compilation)", kept_status
    assert left_status == "left as it is (JAXNN_MALLOC=0)"
    # Left as it is, each round maps its block afresh: 12,288 pages of 4 KiB; kept, the heap reuses it.
    assert float(left) > 10000, left
    assert float(kept) < 100, kept


@needs_glibc
def test_one_arena_is_asked_for_by_name():
    (line,) = _run("import jaxnn\nfrom jaxnn._src import malloc\nprint(malloc.status())", JAXNN_MALLOC="one-arena")
    assert line == "kept between runs (one arena, no mmap, trimmed after each compilation)"


def test_an_unknown_setting_is_one_line_naming_it():
    code = "import jaxnn"
    environ = {**os.environ, "JAXNN_MALLOC": "yes"}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: JAXNN_MALLOC='yes': choose one of 1, one-arena, 0 (unset means 1)"
    )


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
