"""jaxnn keeps the memory of XLA's CPU programs mapped between runs (jaxnn/_src/malloc.py): where a program calls
`jaxnn.keep_host_memory()` before jax starts, a program with a large scratch buffer stops faulting its pages in
afresh on every call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxnn._src import malloc

# Allocates, writes and frees a 48 MB block with malloc again and again, on the main thread ("main") or on a thread
# of its own ("thread", the case of XLA's workers: the block lives in that thread's arena), and reports the status of
# jaxnn's malloc settings and the minor page faults per round after the first few. 48 MB is above the largest size
# glibc's own threshold ever keeps instead of mapping (32 MB) and the largest scratch block jaxnn asks XLA for.
# (Not numpy: it asks for huge pages for its large buffers itself.)
_FAULTS = textwrap.dedent(
    """
    import ctypes, resource, sys, threading
    import jaxnn
    jaxnn.keep_host_memory(split_scratch=True)
    from jaxnn._src import malloc

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 48 * 2**20
    faults = []

    def round_trip():
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)

    def rounds():
        for _ in range(3):
            round_trip()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            round_trip()
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)

    if sys.argv[1] == "thread":
        worker = threading.Thread(target=rounds)
        worker.start()
        worker.join()
    else:
        rounds()
    print(malloc.status())
    print(faults[0])
    """
)

# A jitted program whose scratch (six 16 MB intermediates alive at once, 96 MB) is over the 64 MB a thread's heap
# holds, run on XLA's worker threads; prints the minor page faults of each of 11 runs after 20 warm-up runs.
_XLA_FAULTS = textwrap.dedent(
    """
    import resource
    import jaxnn
    jaxnn.keep_host_memory(split_scratch=True)
    import jax, jax.numpy as jnp

    @jax.jit
    def f(x):
        ys = jax.lax.optimization_barrier([jnp.sin(x * i) for i in range(1, 7)])
        return sum(y.sum() for y in ys)

    x = jnp.ones((2048, 2048))
    assert f.lower(x).compile().memory_analysis().temp_size_in_bytes > 64 * 2**20
    for _ in range(20):
        f(x).block_until_ready()
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)

KEPT = "kept between runs (scratch in blocks of at most 48 MB, no mmap, trimmed after each compilation)"
_STATUS = "import jaxnn, os\nprint(jaxnn.keep_host_memory(split_scratch=True))\nprint(os.environ['XLA_FLAGS'])"


def _run(code: str, *args: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAXNN_MALLOC", "JAX_PLATFORMS")}
    environ.update({"XLA_FLAGS": "", "JAX_NUM_CPU_DEVICES": "1", **env})
    cmd = [sys.executable, "-c", code, *args]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc.platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)


@pytest.mark.system  # starts processes
@needs_glibc
@pytest.mark.parametrize("where", ["main", "thread"])
def test_freed_memory_is_reused_instead_of_mapped_and_faulted_in_afresh(where):
    kept_status, kept = _run(_FAULTS, where, JAX_PLATFORMS="cpu")
    left_status, left = _run(_FAULTS, where, JAX_PLATFORMS="cpu", JAXNN_MALLOC="0")
    assert kept_status == KEPT, kept_status
    assert left_status == "left as it is (JAXNN_MALLOC=0)"
    # Left as it is, each round maps its block afresh: 12,288 pages of 4 KiB; kept, the heap reuses it (on a
    # thread, glibc would also unmap the thread's heap each time it empties, but for the top pad).
    assert float(left) > 10000, left
    assert float(kept) < 100, kept


@pytest.mark.system  # starts processes
@needs_glibc
def test_a_program_with_more_scratch_than_a_thread_heap_stops_faulting():
    kept = sorted(int(n) for n in _run(_XLA_FAULTS, JAX_PLATFORMS="cpu"))
    left = sorted(int(n) for n in _run(_XLA_FAULTS, JAX_PLATFORMS="cpu", JAXNN_MALLOC="0"))
    # Left as it is, every run maps its 96 MB afresh (24,576 pages); kept, in blocks of at most 48 MB, a run
    # faults only where its blocks find no room in the heaps already built (ever rarer as a process goes on:
    # hence the median).
    assert left[5] > 20000, left
    assert kept[5] < 1000, kept


@pytest.mark.system  # starts processes
@needs_glibc
def test_scratch_blocks_are_asked_of_xla_unless_the_user_set_them():
    status, flags = _run(_STATUS, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert status == KEPT
    assert flags == "--xla_cpu_enable_fast_math=false --xla_multiheap_size_constraint_per_heap=50331648"
    status, flags = _run(_STATUS, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_multiheap_size_constraint_per_heap=-1")
    assert "scratch blocks as XLA_FLAGS sets them" in status
    assert flags == "--xla_multiheap_size_constraint_per_heap=-1"
    status, flags = _run(_STATUS, JAX_PLATFORMS="cpu", JAXNN_MALLOC="0", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert flags == "--xla_cpu_enable_fast_math=false"


@pytest.mark.system  # starts processes
@needs_glibc
def test_buffers_larger_than_a_block_compile_without_xla_warning_about_each_unless_the_user_asks():
    # Two 64 MB intermediates alive at once: XLA warns about each buffer over the block size while it places them.
    code = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "jax first":  # jax's import reads the log level: too late to lower it
            import jax
        import jaxnn
        jaxnn.keep_host_memory(split_scratch=True)
        import jax, jax.numpy as jnp
        x = jnp.ones((4096, 4096))
        compiled = jax.jit(lambda x: (jnp.sin(x) @ jnp.cos(x)).sum()).lower(x).compile()
        print(compiled.memory_analysis().temp_size_in_bytes)
        """
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("JAXNN_MALLOC", "JAX_PLATFORMS", malloc.LOG_LEVEL)}
    environ.update(XLA_FLAGS="", JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    warning = "larger than the per-heap size limit"
    cases = (("jaxnn first", None, False), ("jaxnn first", "0", True), ("jax first", None, True))
    for order, user_level, warned in cases:
        env = environ if user_level is None else {**environ, malloc.LOG_LEVEL: user_level}
        cmd = [sys.executable, "-c", code, order]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout) > 2 * 48 * 2**20
        assert (warning in out.stderr) == warned, out.stderr[-2000:]


@pytest.mark.system  # starts processes
@needs_glibc
def test_one_arena_is_asked_for_by_name():
    (line, _) = _run(_STATUS, JAX_PLATFORMS="cpu", JAXNN_MALLOC="one-arena")
    assert line == KEPT.replace("(", "(one arena, ")


@pytest.mark.system  # starts processes
def test_an_unknown_setting_is_one_line_naming_it():
    code = "import jaxnn"
    environ = {**os.environ, "JAXNN_MALLOC": "yes"}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: JAXNN_MALLOC='yes': choose one of 1, one-arena, 0 (unset: only where a program asks)"
    )


@pytest.mark.system  # starts processes
def test_it_is_left_alone_once_jax_has_started_and_where_an_accelerator_is_configured():
    started = "import jax; jax.numpy.ones(1).block_until_ready()\nimport jaxnn\n"
    (line,) = _run(started + "print(jaxnn.keep_host_memory())", JAX_PLATFORMS="cpu")
    assert line == "left as it is (jax had started before the settings were asked for)"
    (line,) = _run("import jaxnn\nprint(jaxnn.keep_host_memory())", JAX_PLATFORMS="cuda,cpu")
    assert line == "left as it is (an accelerator platform is configured or installed)"


def test_an_installed_accelerator_plugin_counts_as_configured(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(malloc.sys, "modules", {k: v for k, v in sys.modules.items() if k != "jax"})
    monkeypatch.setattr(malloc.importlib.metadata, "entry_points", lambda group: ["xla_cuda13"])
    assert malloc._accelerator_present()
    monkeypatch.setattr(malloc.importlib.metadata, "entry_points", lambda group: [])
    assert not malloc._accelerator_present()


def test_the_command_splits_the_scratch_where_steps_gain_more_than_a_cache_saves():
    from jaxnn.cli.main import SHORT_RUN_STEPS, build_parser, split_scratch

    def split(*argv: str) -> bool:
        return split_scratch(build_parser().parse_args(list(argv)))

    assert not split("train", "--steps", str(SHORT_RUN_STEPS), "--compile-cache", "/tmp/c")  # short: cached
    assert split("train", "--steps", str(SHORT_RUN_STEPS + 1), "--compile-cache", "/tmp/c")  # long: split
    assert split("train", "--compile-cache", "/tmp/c")  # the model's default steps
    assert split("train", "--steps", "1", "--no-compile-cache")  # nothing to cache
    assert not split("generate", "--run-dir", "r", "--compile-cache", "/tmp/c")
