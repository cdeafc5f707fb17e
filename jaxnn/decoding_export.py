"""KV-cache decoding as two `jax.export` programs that generate text without jaxnn: the prefill and the step.

`write_decoding_export(out_dir, model, params, ...)` writes

- `prefill.jaxexport`: `(weights, ids (b, T) int32, mask (b, T) bool) -> (logits (b, vocab) float32, *cache)`:
  left-padded prompts (mask False on the padding) through the model once; the logits are those of the last slot.
- `step.jaxexport`: `(weights, token (b,) int32, position (b,) int32, *cache) -> (logits, *cache)`: one new
  position per row; a row's position is its prompt length plus the number of tokens it has been given since.
- `weights.safetensors` (the flat names `jaxnn.export.flat_weights` gives) and `decoding.json` (T, the cache's
  length, the cache arrays' names, shapes and dtypes).

The batch size b is symbolic: any batch runs without a new export. The cache is plain arrays passed in and
returned, so the caller owns it; `examples/generate_exported.py` is such a caller, with numpy and jax only.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxnn._src import pytree
from jaxnn._src.ownership import check_export_dir
from jaxnn._src.storage import check_writable, make_dirs, write_bytes_atomic, write_json_atomic
from jaxnn.export import CONFIG_KEY, STATE_PREFIX, WEIGHTS_FILE, check_platforms, flat_weights, save_safetensors

if TYPE_CHECKING:
    from jaxnn.layers import Layer
    from jaxnn.precision import Policy

PREFILL_FILE = "prefill.jaxexport"
STEP_FILE = "step.jaxexport"
INFO_FILE = "decoding.json"


def export_decoding(
    model: Layer,
    params: Any,
    model_state: Any = None,
    *,
    prompt_len: int,
    cache_len: int,
    policy: Policy | str = "fp32",
    platforms: str | Sequence[str] = ("cpu",),
) -> tuple[Any, Any]:
    """The `jax.export.Exported` prefill and step programs (see the module docstring) for prompts of at most
    `prompt_len` tokens and `cache_len` positions in all (prompt slots plus new tokens)."""
    import jax
    import jax.numpy as jnp

    from jaxnn.decoding import decode_step, positions_of
    from jaxnn.kernels import onednn
    from jaxnn.layers.core import run_cached
    from jaxnn.precision import get_policy

    if model.init_cache is None:
        raise ValueError(f"export_decoding: model {model.name!r} has no decoding cache (no causal attention layer)")
    if not (isinstance(prompt_len, int) and isinstance(cache_len, int) and 1 <= prompt_len < cache_len):
        raise ValueError(f"export_decoding: need 1 <= prompt_len < cache_len, got {prompt_len!r} and {cache_len!r}")
    platforms = check_platforms(platforms)
    policy = get_policy(policy)
    names = list(pytree.flatten(params))
    state_names = list(pytree.flatten(model_state or {}))
    param_def = jax.tree_util.tree_structure(params)
    state_def = jax.tree_util.tree_structure(model_state or {})
    cache_def: list[Any] = []  # the cache's tree structure, found when the prefill is traced

    def trees(weights):
        p = jax.tree_util.tree_unflatten(param_def, [weights[n] for n in names])
        s = jax.tree_util.tree_unflatten(state_def, [weights[STATE_PREFIX + n] for n in state_names])
        return policy.cast_to_compute(p), s

    def prefill(weights, ids_BT, mask_BT):
        p, s = trees(weights)
        cache = model.init_cache(ids_BT.shape, cache_len, policy.compute_dtype)  # type: ignore[misc]
        side = {"mask": mask_BT, "positions": positions_of(mask_BT)}
        logits_BTV, cache = run_cached(model, p, ids_BT, cache, state=s, policy=policy, **side)
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        cache_def.append(treedef)
        return (logits_BTV[:, -1].astype(jnp.float32), *leaves)

    def step(weights, token_B, position_B, *leaves):
        p, s = trees(weights)
        cache = jax.tree_util.tree_unflatten(cache_def[0], leaves)
        logits_BV, cache = decode_step(model, p, s, policy, token_B, position_B, cache)
        return (logits_BV.astype(jnp.float32), *jax.tree_util.tree_leaves(cache))

    weights = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in flat_weights(params, model_state).items()}
    (b,) = jax.export.symbolic_shape("b")
    ids = jax.ShapeDtypeStruct((b, prompt_len), jnp.int32)
    # The programs run without jaxnn, so they never call jaxnn's optional oneDNN kernels.
    with onednn.use(False):
        exported_prefill = jax.export.export(jax.jit(prefill), platforms=platforms)(
            weights, ids, jax.ShapeDtypeStruct((b, prompt_len), jnp.bool_)
        )
        cache_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported_prefill.out_avals[1:]]
        row = jax.ShapeDtypeStruct((b,), jnp.int32)
        exported_step = jax.export.export(jax.jit(step), platforms=platforms)(weights, row, row, *cache_specs)
    return exported_prefill, exported_step


def write_decoding_export(
    out_dir: str | os.PathLike[str],
    model: Layer,
    params: Any,
    model_state: Any = None,
    *,
    prompt_len: int,
    cache_len: int,
    policy: Policy | str = "fp32",
    platforms: str | Sequence[str] = ("cpu",),
    config: dict | None = None,
) -> pathlib.Path:
    """Writes the prefill and step programs, the weights and decoding.json to `out_dir` (see the module
    docstring); returns it. A folder holding another export or foreign files is refused before anything is
    written."""
    import jax

    out = pathlib.Path(out_dir)
    check_writable(out)
    files = (PREFILL_FILE, STEP_FILE, WEIGHTS_FILE, INFO_FILE)
    check_export_dir(out, config, files, info_file=INFO_FILE, config_key=CONFIG_KEY)
    prefill, step = export_decoding(
        model, params, model_state, prompt_len=prompt_len, cache_len=cache_len, policy=policy, platforms=platforms
    )
    cache_shape = jax.eval_shape(lambda: model.init_cache((1, prompt_len), cache_len, "float32"))  # type: ignore[misc]
    make_dirs(out)
    write_bytes_atomic(out / PREFILL_FILE, bytes(prefill.serialize()))
    write_bytes_atomic(out / STEP_FILE, bytes(step.serialize()))
    save_safetensors(params, out / WEIGHTS_FILE, model_state=model_state, config=config)
    info = {
        "prompt_len": prompt_len,
        "cache_len": cache_len,
        "vocab_size": int(prefill.out_avals[0].shape[-1]),
        "cache": [
            {"name": name, "shape": [d if isinstance(d, int) else str(d) for d in a.shape], "dtype": str(a.dtype)}
            for name, a in zip(pytree.flatten(cache_shape), step.in_avals[-len(prefill.out_avals) + 1 :])
        ],
        "platforms": list(prefill.platforms),
        "policy": policy if isinstance(policy, str) else policy.name,
        "jax_version": jax.__version__,
        "config": config,
    }
    write_json_atomic(out / INFO_FILE, info)  # last: a folder with decoding.json is complete
    return out
