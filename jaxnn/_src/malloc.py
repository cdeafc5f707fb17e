"""Keep the memory of XLA's CPU programs mapped from one run to the next (glibc's malloc, Linux).

Why: XLA's CPU runtime allocates each run's scratch buffer (`Compiled.memory_analysis().temp_size_in_bytes`) with
malloc on one of its own threads and frees it when the run ends. glibc serves a large request from a fresh `mmap`
and returns it with `munmap`, so every step the kernel maps and zeroes each page again: 10,500 page faults and 23 ms
of system time per 40 ms CNN step, 80,000 and 143 ms per 384 ms GPT step, on a 2-core EPYC (docs/performance.md,
"Host memory between steps").

By default (`JAXNN_MALLOC` unset or 1) jaxnn
- turns off malloc's mmap and its trimming of the heap's free top, so a freed buffer is reused;
- has XLA split each program's scratch into blocks of at most 48 MB (`--xla_multiheap_size_constraint_per_heap`
  appended to `XLA_FLAGS`, unless it is set there already): a thread's arena lives in heaps of 64 MB, and glibc
  maps any larger block afresh whatever its settings (the GPT's scratch is 267 MB in one block otherwise). A
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

glibc reads these settings when a thread first allocates, and XLA its flags when jax first compiles, so they must be
made before jax starts its CPU client: jaxnn makes them when it is imported, where jax has not started yet and no
accelerator is present. Memory a run frees stays with the process; so that it does not also keep the compiler's
peak, the free memory is handed back once after each compilation (`trim_after_compiles`, malloc_trim(3)).
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

# What happened when jaxnn was imported; `status()` reads it.
_status = "not configured"
_libc: ctypes.CDLL | None = None
_trimming = False


def status() -> str:
    """One line: whether this process's malloc keeps freed memory for XLA's next run, or why not."""
    return _status


def _jax_started() -> bool:
    """Whether jax has created a backend (and so its threads) in this process; False where jax is not imported."""
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


def _mode() -> str:
    mode = os.environ.get(ENV_SWITCH, "").strip() or "1"
    if mode not in MODES:
        raise ValueError(f"{ENV_SWITCH}={mode!r}: choose one of {', '.join(MODES)} (unset means 1)")
    return mode


def _reason_not_to(mode: str) -> str | None:
    if mode == "0":
        return f"left as it is ({ENV_SWITCH}=0)"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "left as it is (not glibc)"
    if _jax_started():
        return "left as it is (jax had started before jaxnn was imported)"
    if _accelerator_present():
        return "left as it is (an accelerator platform is configured or installed)"
    return None


def keep_host_memory() -> str:
    """Sets glibc's malloc to map no blocks of its own and keep its heaps (with `JAXNN_MALLOC=one-arena`, one arena
    for every thread), and XLA to split its scratch into blocks those heaps hold, where that helps (see the module's
    docstring); returns and records `status()`. Safe to call more than once; raises only for an unknown
    `JAXNN_MALLOC`."""
    global _status, _libc
    mode = _mode()
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
    _status = f"kept between runs ({arenas}{_split_scratch()}, no mmap, trimmed after each compilation)"
    return _status


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
    """XLA's C++ warnings off (errors kept) unless the user chose a log level (see the module's docstring)."""
    if os.environ.get(LOG_LEVEL, JAX_LOG_LEVEL) != JAX_LOG_LEVEL:
        return
    os.environ[LOG_LEVEL] = "2"
    if "jax" in sys.modules:
        # jaxlib read the variable when jax was imported; this is the call jax's own `jax_logging_level` makes.
        try:
            from jax._src.lib import utils

            utils.absl_set_min_log_level(2)
        except (ImportError, AttributeError):
            pass


def trim_after_compiles() -> None:
    """Where `keep_host_memory` took effect, hands the process's free memory back to the system after every jax
    compilation (once per process; imports jax). Without it the heap would keep the compiler's peak as well."""
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
