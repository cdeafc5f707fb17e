"""Keep the memory of XLA's CPU programs mapped from one run to the next (glibc's malloc, Linux).

Why: XLA's CPU runtime allocates each run's scratch buffer (`Compiled.memory_analysis().temp_size_in_bytes`) with
malloc on one of its own threads and frees it when the run ends. glibc serves a large request from a fresh `mmap`
and returns it with `munmap`, so every step the kernel maps and zeroes each page again: 10,500 page faults and 23 ms
of system time per 40 ms CNN step, 80,000 and 143 ms per 384 ms GPT step, on a 2-core EPYC (docs/performance.md,
"Host memory between steps").

Where a program asks for it (below), jaxnn
- turns off malloc's mmap and its trimming of the heap's free top, so a freed buffer is reused;
- has XLA split each program's scratch (unless the compilation cache is on, see below) into blocks of at most
  48 MB (`--xla_multiheap_size_constraint_per_heap` appended to `XLA_FLAGS`, unless it is set there already): a
  thread's arena lives in heaps of 64 MB, and glibc maps any larger block afresh whatever its settings (the GPT's
  scratch is 267 MB in one block otherwise). A
  single buffer larger than a block still gets an allocation of its own, as without the flag, but XLA then warns
  about it on every compilation, once for each block it fills while such buffers wait (so the lines grow with the
  square of their number); so jaxnn also sets TF_CPP_MIN_LOG_LEVEL=2 (XLA's C++ errors shown, its warnings not)
  where it is unset or 1 (jax's own default; 0 shows every message);
- keeps a thread's heap when it empties (a top pad of a whole heap, `M_TOP_PAD`), which glibc would otherwise
  unmap, so the next run's blocks are faulted in again.
The GPT's fp32 step then runs without faults (343 -> 290 ms over 7 rounds of `make bench-peers`). The cost is
memory: each of XLA's worker threads that runs a program keeps that program's scratch in its own arena (two threads
took turns on the 2-core machine measured). `JAXNN_MALLOC=one-arena` puts every thread on the main arena instead,
one copy for all, but jax's dispatch thread and XLA's then share one lock (the tiny MLP's 30 us step took twice as
long). Arenas are not capped either: glibc puts the threads beyond a cap on arenas in turn, the main thread's among
them, which is one arena's lock again for some of XLA's workers. `JAXNN_MALLOC=0` leaves malloc and XLA_FLAGS as
they are.

Nothing of this happens on `import jaxnn`: a library leaves the process it is imported into alone. A program opts
in with one call, `jaxnn.keep_host_memory()`, made before jax starts (glibc reads its settings when a thread first
allocates, XLA its flags when jax creates its CPU client, jaxlib the log level when jax is imported), or through
its environment: with `JAXNN_MALLOC` set to 1 or one-arena, `import jaxnn` makes that call itself. The `jaxnn`
command and the make targets make it (`JAXNN_MALLOC=0` keeps them from it).

The scratch blocks and XLA's persistent compilation cache exclude each other for large programs: XLA cannot
serialise a program whose scratch is split into several blocks ("Multiple temp buffer allocations found"), so such
a program would compile again in every process. `keep_host_memory(split_scratch=None)` therefore splits the
scratch only where jaxnn's compilation cache is off (`JAXNN_COMPILE_CACHE=off`); the `jaxnn` command also splits it
for long training runs, whose steps gain more than a cache saves (`jaxnn.cli.main.split_scratch`); malloc's own
settings apply either way (docs/performance.md, "Host memory between steps", has both figures).
Memory a run frees stays with the process; so that it does not also keep the compiler's peak, the free memory is
handed back once after each compilation (malloc_trim(3), from a listener on jax's compile events).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import sys

ENV_SWITCH = "JAXNN_MALLOC"
MODES = ("1", "one-arena", "0")

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest free top of the heap kept instead of returned
# glibc's heaps for threads' arenas are 64 MB on 64-bit machines (HEAP_MAX_SIZE); a top pad of a whole heap makes
# glibc keep a heap that empties (its check for unmapping one compares the room left against the pad).
_THREAD_HEAP = 64 * 2**20

# XLA's scratch in blocks a thread's heap holds, with room for the heap's own header and the run's small buffers.
XLA_FLAG = "--xla_multiheap_size_constraint_per_heap"
SCRATCH_BLOCK = 48 * 2**20
# XLA's C++ log threshold (jaxlib reads it when jax is imported): 2 keeps errors, drops the warning each larger
# buffer gets. jax's import sets 1 where it is unset, so 1 counts as unset.
LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
JAX_LOG_LEVEL = "1"

# jax's monitoring event recorded after each backend compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# What the last `keep_host_memory` call did; `status()` reads it.
_status = "not configured"
_libc: ctypes.CDLL | None = None
_trimming = False


def status() -> str:
    """One line: whether this process's malloc keeps freed memory for XLA's next run, or why not."""
    return _status


def _jax_started() -> bool:
    """Whether jax has created a backend (and so its threads) in this process; False where jax is not imported.
    Read without importing anything: jax offers no public question that does not itself start a backend."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def _accelerator_present() -> bool:
    """Whether jax may run on something other than the CPU here: JAX_PLATFORMS (or jax's config) names another
    platform, or, where neither is set, a PJRT plugin (CUDA, ROCm) or libtpu is installed. Scratch buffers live
    on the device there, and malloc is best left to the host's own work."""
    jax_module = sys.modules.get("jax")
    platforms = os.environ.get("JAX_PLATFORMS") or getattr(getattr(jax_module, "config", None), "jax_platforms", None)
    if platforms:
        return any(p.strip() not in ("cpu", "") for p in str(platforms).split(","))
    if importlib.util.find_spec("libtpu") is not None:
        return True
    try:
        return bool(importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # a broken distribution's metadata: assume the plugins are there
        return True


def requested_mode() -> str | None:
    """What `JAXNN_MALLOC` asks for: one of MODES, or None where it is unset (or empty)."""
    mode = os.environ.get(ENV_SWITCH, "").strip()
    if not mode:
        return None
    if mode not in MODES:
        raise ValueError(f"{ENV_SWITCH}={mode!r}: choose one of {', '.join(MODES)} (unset: only where a program asks)")
    return mode


def _reason_not_to(mode: str) -> str | None:
    if mode == "0":
        return f"left as it is ({ENV_SWITCH}=0)"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "left as it is (not glibc)"
    if _jax_started():
        return "left as it is (jax had started before the settings were asked for)"
    if _accelerator_present():
        return "left as it is (an accelerator platform is configured or installed)"
    return None


def _compile_cache_off() -> bool:
    """Whether jaxnn's persistent compilation cache is off by the environment (`JAXNN_COMPILE_CACHE`)."""
    from jaxnn._src import compile_cache

    try:
        return compile_cache.resolve("auto") is None
    except ValueError:
        return False


def keep_host_memory(split_scratch: bool | None = None) -> str:
    """Keeps the memory of XLA's CPU programs mapped between runs, for this process: glibc's malloc maps no blocks
    of its own and keeps its heaps (with `JAXNN_MALLOC=one-arena`, one arena for every thread), free memory is
    handed back after each compilation and, with `split_scratch`, XLA splits each program's scratch into blocks
    those heaps hold (None: only where `JAXNN_COMPILE_CACHE` turns jaxnn's compilation cache off, since XLA
    cannot cache a program whose scratch it split). See the module's docstring for what it buys and costs.

    Call it first in a program, before jax is imported or at least before it computes anything; `JAXNN_MALLOC=0`
    makes it a no-op. Returns and records `status()`, one line; safe to call more than once; raises only for an
    unknown `JAXNN_MALLOC`.
    """
    global _status, _libc
    mode = requested_mode() or "1"
    reason = _reason_not_to(mode)
    if reason is not None:
        _status = reason
        return _status
    settings = ([(M_ARENA_MAX, 1)] if mode == "one-arena" else []) + [
        (M_MMAP_MAX, 0),
        (M_TRIM_THRESHOLD, _NEVER_TRIM),
        (M_TOP_PAD, _THREAD_HEAP),
    ]
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = [libc.mallopt(p, v) for p, v in settings]
    except (OSError, AttributeError):
        done = []
    if not (done and all(done)):
        _status = "left as it is (mallopt)"
        return _status
    _libc = libc
    arenas = "one arena, " if mode == "one-arena" else ""
    split = _compile_cache_off() if split_scratch is None else split_scratch
    scratch = _split_scratch() if split else "scratch in one block, cacheable"
    _trim_after_compiles()
    _status = f"kept between runs ({arenas}{scratch}, no mmap, trimmed after each compilation)"
    return _status


def apply_requested() -> None:
    """`import jaxnn`'s one step: keeps host memory only where `JAXNN_MALLOC` is set to 1 or one-arena."""
    if requested_mode() in ("1", "one-arena"):
        keep_host_memory()


def _split_scratch() -> str:
    """Asks XLA (through XLA_FLAGS, read at jax's first compilation) for scratch blocks a thread's heap holds;
    a constraint the user set there already is theirs. Returns the part of `status()` that says which."""
    ours = f"{XLA_FLAG}={SCRATCH_BLOCK}"
    flags = os.environ.get("XLA_FLAGS", "")
    if XLA_FLAG in flags and ours not in flags:
        return "scratch blocks as XLA_FLAGS sets them"
    if ours not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {ours}".strip()
    _quiet_block_warnings()
    return f"scratch in blocks of at most {SCRATCH_BLOCK // 2**20} MB"


def _quiet_block_warnings() -> None:
    """XLA's C++ warnings off (errors kept) unless the user chose a log level (see the module's docstring).
    jaxlib reads the level when jax is imported, so where jax is imported already the warnings stay."""
    if os.environ.get(LOG_LEVEL, JAX_LOG_LEVEL) != JAX_LOG_LEVEL or "jax" in sys.modules:
        return
    os.environ[LOG_LEVEL] = "2"


def _trim_after_compiles() -> None:
    """Hands the process's free memory back to the system after every jax compilation (once per process; imports
    jax, but starts no backend). Without it the heap would keep the compiler's peak as well."""
    global _trimming
    if _libc is None or _trimming:
        return
    import jax.monitoring

    libc = _libc

    def trim(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == COMPILE_EVENT:
            libc.malloc_trim(0)

    jax.monitoring.register_event_duration_secs_listener(trim)
    _trimming = True
