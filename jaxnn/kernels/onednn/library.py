"""Finding, loading and registering the compiled oneDNN kernels, and the switch that says whether layers use them.

The shared library is built by `make install` (mk/onednn.mk) next to this file from `onednn_ffi.cc`, against the
oneDNN of the `onednn` extra (`pip install 'jaxnn[onednn]'`, the onednn-cpu-gomp wheel) and the XLA FFI headers
jaxlib ships. It is loaded on first use, never at import, so `import jaxnn` costs nothing where it is absent.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax import lax
from jax.typing import DTypeLike

# Versioned like a system library, and so not taken for a Python extension module (pkgutil would import it).
LIBRARY_NAME = "libjaxnn_onednn.so.0"
# JAXNN_ONEDNN_LIBRARY: another build of the library; JAXNN_ONEDNN: "1" uses the kernels in layers, "0" never,
# unset: where they measured faster than XLA's on this CPU (`choice`).
ENV_LIBRARY = "JAXNN_ONEDNN_LIBRARY"
ENV_SWITCH = "JAXNN_ONEDNN"
TARGETS = {
    "conv_fwd": "jaxnn_onednn_conv_fwd",
    "conv_bwd_data": "jaxnn_onednn_conv_bwd_data",
    "conv_bwd_weights": "jaxnn_onednn_conv_bwd_weights",
    "matmul": "jaxnn_onednn_matmul",
}
BUILD_HINT = "build them with `make install` (needs a C++ compiler and `pip install 'jaxnn[onednn]'`)"

# `use`'s setting: True, False, _MEASURED (this machine's measured default), or None (not set: JAXNN_ONEDNN decides).
_MEASURED = "measured"
_override: contextvars.ContextVar[bool | str | None] = contextvars.ContextVar("jaxnn_onednn", default=None)


def library_path() -> str:
    """Where the shared library is looked for: $JAXNN_ONEDNN_LIBRARY, else next to this file."""
    return os.environ.get(ENV_LIBRARY) or os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)


def _load_dnnl() -> None:
    # The wheel puts libdnnl.so.3 in the environment's lib/; loading it globally first lets the dynamic loader
    # resolve our library's dependency wherever the environment was moved to (the build's rpath is a fallback).
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libdnnl.so.3")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    path = library_path()
    if not os.path.exists(path):
        return None, f"the jaxnn oneDNN kernels are not built ({path} is missing); {BUILD_HINT}"
    try:
        _load_dnnl()
        lib = ctypes.CDLL(path)
    except OSError as err:
        return None, f"the jaxnn oneDNN kernels at {path} do not load ({err}); {BUILD_HINT}"
    for target in TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    lib.jaxnn_onednn_version.restype = ctypes.c_char_p
    return lib, None


def unavailable_reason() -> str | None:
    """None when the kernels are built and loaded (registering them with XLA on first call), else why not."""
    return _load()[1]


def available() -> bool:
    """Whether the kernels are built and load on this machine."""
    return unavailable_reason() is None


def version() -> str | None:
    """The oneDNN version the kernels were built against, or None where they are not available."""
    lib = _load()[0]
    return None if lib is None else lib.jaxnn_onednn_version().decode()


@functools.cache
def supports_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (oneDNN 3.2 builds them for AVX-512 and AVX2-VNNI-2 CPUs
    only); False where the kernels are not available. Where it is False, bfloat16 stays on XLA's kernels."""
    lib = _load()[0]
    return lib is not None and bool(lib.jaxnn_onednn_supports_bf16())


def check_dtype(dtype: DTypeLike, kernel: str) -> None:
    """Raise in one line where the kernels are not available, or `dtype` is bfloat16 on a CPU oneDNN has no
    bfloat16 kernels for."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if jax.numpy.dtype(dtype) == jax.numpy.bfloat16 and not supports_bf16():
        raise RuntimeError(
            f"onednn {kernel}: oneDNN {version()} has no bfloat16 kernels for this CPU (they need AVX-512 or "
            "AVX2-VNNI-2); use float32, or XLA's kernels (Conv(lowering='auto'))"
        )


def enabled(kind: str = "conv", dtype: DTypeLike = "float32") -> bool:
    """Whether layers take the kernels of `kind` ("conv" or "matmul") for `dtype` on the CPU now: built (with
    bfloat16 kernels for this CPU, for bf16), and switched on by `use(flag)`, else by JAXNN_ONEDNN=1/0, else by
    this machine's measured default (`jaxnn.kernels.onednn.choice`: each kind where it beats XLA's kernels here).
    Read when a computation is traced."""
    if kind not in ("conv", "matmul"):
        raise ValueError(f"onednn.enabled: kind is 'conv' or 'matmul', got {kind!r}")
    dtype = jax.numpy.dtype(dtype)
    if dtype not in (jax.numpy.dtype(jax.numpy.float32), jax.numpy.dtype(jax.numpy.bfloat16)):
        return False
    flag = forced()
    env = os.environ.get(ENV_SWITCH, "").strip()
    if _override.get() is None and env and flag and not available():
        _warn_switch_has_no_effect(env)
    if not available() or (dtype == jax.numpy.bfloat16 and not supports_bf16()):
        return False
    if flag is None:
        from jaxnn.kernels.onednn.choice import default_choices

        return default_choices(version())[f"{kind}_{'bf16' if dtype == jax.numpy.bfloat16 else 'f32'}"]
    return flag


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def forced() -> bool | None:
    """The switch as set by `use(flag)` or JAXNN_ONEDNN (True/False), or None where this machine's measured default
    applies (then callers may also leave out calls too small to be worth a kernel's fixed cost)."""
    flag = _override.get()
    if flag is None:
        return _switch_value(os.environ.get(ENV_SWITCH, "").strip())
    return None if flag == _MEASURED else bool(flag)


def _switch_value(env: str) -> bool | None:
    """JAXNN_ONEDNN's value as on/off; None (the measured default) when unset or neither, which is said once."""
    if env.lower() in _ON:
        return True
    if env.lower() in _OFF:
        return False
    if env:
        _warn_unknown_switch(env)
    return None


@functools.cache
def _warn_unknown_switch(value: str) -> None:
    warnings.warn(f"{ENV_SWITCH}={value!r} is not 1 or 0 (on/off, true/false, yes/no): ignored, this CPU's "
                  "default applies", RuntimeWarning, stacklevel=5)  # fmt: skip


@functools.cache
def _warn_switch_has_no_effect(value: str) -> None:
    """Said once per process: a JAXNN_ONEDNN=1 that cannot take effect must not pass for one that did."""
    warnings.warn(f"{ENV_SWITCH}={value} has no effect: {unavailable_reason()}", RuntimeWarning, stacklevel=3)


def call(
    target: str, shape: Sequence[int], dtype: DTypeLike, *operands: jax.Array, vmap_method: str, **attrs: Any
) -> jax.Array:
    """One kernel call (`TARGETS[target]`) returning a `shape`, `dtype` array.

    Under `jax.shard_map` the result varies over the mesh axes any operand varies over, and every operand is cast
    to vary over all of them (a weight replicated across the data axis meets a per-shard cotangent): XLA's FFI
    call needs operands of one such type and does not infer the result's."""
    varying = frozenset().union(*(jax.typeof(x).mat.varying for x in operands))
    operands = tuple(
        x
        if jax.typeof(x).mat.varying == varying
        else lax.pcast(x, tuple(varying - jax.typeof(x).mat.varying), to="varying")
        for x in operands
    )
    out = jax.ShapeDtypeStruct(tuple(shape), dtype)
    if varying:  # the type names the manual mesh it varies over
        aval = jax.typeof(operands[0])
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
        out = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding, manual_axis_type=aval.mat)
    return jax.ffi.ffi_call(TARGETS[target], out, vmap_method=vmap_method)(*operands, **attrs)


def like_primal(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """`cotangent` summed over the mesh axes it varies over and `primal` does not (inside `jax.shard_map`): what
    autodiff does for the implicit cast `call` makes, and what a custom_vjp's backward rule must return."""
    extra = jax.typeof(cotangent).mat.varying - jax.typeof(primal).mat.varying
    return lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


@contextlib.contextmanager
def use(flag: bool | None) -> Iterator[None]:
    """Within the block, programs traced take the oneDNN kernels (`True`, where they are built), never do
    (`False`), or take the ones this machine measured faster (`None`, also over JAXNN_ONEDNN)."""
    token = _override.set(_MEASURED if flag is None else flag)
    try:
        yield
    finally:
        _override.reset(token)
