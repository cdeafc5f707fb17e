"""JAX's persistent compilation cache, on by default for `jaxnn train` and `jaxnn.fit`.

A second run of the same model loads its compiled programs from disk instead of compiling them again. Where:

- `compile_cache="auto"` (the default): `$JAXNN_COMPILE_CACHE` if set, else `$XDG_CACHE_HOME/jaxnn/xla`
  (`~/.cache/jaxnn/xla`);
- `compile_cache="off"` (or `JAXNN_COMPILE_CACHE` set to "", "off", "0", "false", "none"): no cache;
- any other value: that directory.

A cache directory the user gave jax directly (`JAX_COMPILATION_CACHE_DIR`, `jax.config.update(...)`) is kept.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
from typing import Any

from jaxnn.errors import CompileCacheError  # noqa: F401 (also importable from here)

ENV = "JAXNN_COMPILE_CACHE"
OFF_WORDS = ("", "off", "0", "false", "none", "no")
# Every program of a run is worth caching on the CPU: a warm start's time is the sum of dozens of small compiles
# (init, optimizer, eval and train steps), most under jax's default threshold of 1 s (docs/performance.md).
MIN_COMPILE_SECONDS = 0.0
# A bound on the disk the cache takes; setting one also makes jax lock the directory (filelock) on every read
# and write, so that concurrent runs never read an entry another one is still writing.
MAX_BYTES = 2 * 1024**3

_enabled_dir: str | None = None
log = logging.getLogger(__name__)


def _jax_option(name: str) -> Any:
    import jax

    return getattr(jax.config, name)  # options are attributes of jax.config that its type stubs do not list


def _scratch_split() -> bool:
    """Whether XLA_FLAGS has XLA split programs' scratch into blocks (a positive size per heap; -1 is XLA's off)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_multiheap_size_constraint_per_heap":  # jaxnn._src.malloc.XLA_FLAG, which imports this
            return value.lstrip("-").isdigit() and int(value) > 0
    return False


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxnn", "xla")


def resolve(setting: str | None = "auto") -> str | None:
    """The cache directory `setting` asks for (None: no cache), reading `JAXNN_COMPILE_CACHE` for "auto"."""
    if setting is None or not isinstance(setting, str):
        raise CompileCacheError(f"compile_cache must be 'auto', 'off' or a directory, got {setting!r}")
    if setting == "auto":
        env = os.environ.get(ENV)
        if env is None:
            return default_dir()
        setting = env
    if setting.strip().lower() in OFF_WORDS:
        return None
    return os.path.abspath(os.path.expanduser(setting))


def enable(setting: str | None = "auto") -> str | None:
    """Points jax's persistent compilation cache at `resolve(setting)`; returns the directory in use (or None).

    Takes effect for every program compiled afterwards in this process. The first directory set stays for the
    process, and "off" after it is a no-op: jax opens its cache once.
    """
    global _enabled_dir
    path = resolve(setting)
    import jax

    current = _jax_option("jax_compilation_cache_dir")
    if current is not None and current != _enabled_dir:
        return current  # the user's own choice
    if path is None or _enabled_dir is not None:
        return _enabled_dir  # jax keeps the cache it opened; it cannot be moved or closed within a process
    try:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if setting != "auto":
            raise CompileCacheError(f"compile cache directory {path}: {err.strerror or err}") from None
        # The default place may be read-only (a locked-down home): run without the cache rather than not at all.
        log.warning("compilation cache off: cannot create %s (%s)", path, err.strerror or err)
        return None
    if _scratch_split():
        log.info(
            "XLA_FLAGS splits programs' scratch (--xla_multiheap_size_constraint_per_heap): XLA cannot write a "
            "program whose scratch it split to the compilation cache, so such programs compile again in every run"
        )
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if importlib.util.find_spec("filelock") is not None and _jax_option("jax_compilation_cache_max_size") == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _enabled_dir = path
    return path
