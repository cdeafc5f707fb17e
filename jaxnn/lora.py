"""LoRA: trainable low-rank adapters beside frozen weights, on any jaxnn model, chosen by parameter-path patterns
(the same shell-style patterns as `jaxnn.finetune.freeze` and the sharding rules).

    lora = LoRA(rank=8, alpha=16, targets=("*attention*.w", "*mlp*.w"))
    params = add_adapters(params, lora, jax.random.key(0))   # each matched Dense weight gets lora_a, lora_b
    tx = train_adapters_only(optax.adamw(1e-4))                # optimizer state for the adapters alone
    jaxnn.fit(model, data, params=params, lora=lora, ...)      # or: fit does both steps itself
    save_adapters("adapters.safetensors", params, lora)        # a small file: the adapters and their settings
    merged = merge(params)                                     # w + alpha/rank * a @ b, adapters gone

With `base="int8"` or `base="nf4"` the weights the adapters attach to are stored quantised (`jaxnn.quantized`):
the frozen base takes a quarter or an eighth of its float32 memory, as in QLoRA.

A matched Dense weight `w` (in, out) gains `lora_a` (in, r), `lora_b` (r, out, zeros: the model starts exactly
where the base was) and `lora_scale` (alpha / r) in the same params dict; Dense adds `scale * (x @ a) @ b` to
`x @ w`. Weights stacked by `Repeat` (leading layer axes) get stacked adapters. The adapters stay plain arrays in
the params tree, so checkpoints, sharding, resume and `jaxnn.checkpoint.load_params` need nothing new.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxnn import fp8, quantized
from jaxnn._src.jaxpr import used_inputs
from jaxnn._src.pytree import flatten, matches, unflatten
from jaxnn.layers.core import Layer
from jaxnn.layers.linear import adapter_dropout
from jaxnn.quantized import check_base

TRAINED = ("lora_a", "lora_b")
ADAPTER_KEYS = (*TRAINED, "lora_scale")
# Every projection of attention and the MLPs of jaxnn's transformer blocks (not embeddings or the logits).
DEFAULT_TARGETS = ("*attention*.w", "*mlp*.w")
FORMAT = "jaxnn-lora"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Adapter settings: `rank` r, `alpha` (the update is scaled by alpha / r, so a new rank needs no new learning
    rate), `dropout` on the adapters' input while training, and the `targets` (patterns over dotted parameter
    names such as "4_block.0_attn.1_attention.qkv.w"; only 2-D Dense weights, or stacks of them, qualify)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA: rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ValueError(f"LoRA: alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA: dropout must be in [0, 1), got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"LoRA: targets must be non-empty name patterns, got {self.targets!r}")
        object.__setattr__(self, "targets", targets)
        check_base(self.base)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def record(self) -> dict[str, Any]:
        """The settings as JSON values (a run's record, an adapter file's header); `as_lora` reads them back."""
        record = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}
        return record if self.base is None else {**record, "base": self.base}


def parse_lora(text: str) -> LoRA:
    """`LoRA` from "r=8,alpha=16,dropout=0.05,base=nf4,targets=*qkv.w,*out.w" (`rank=` also works; every item
    after `targets=` without an `=` is one more target pattern)."""
    fields: dict[str, Any] = {}
    targets: list[str] = []
    in_targets = False
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep and in_targets:
            targets.append(item)
            continue
        key = {"r": "rank"}.get(key.strip(), key.strip())
        in_targets = key == "targets"
        if in_targets:
            targets.append(value.strip())
        elif key in ("rank", "alpha", "dropout") and sep:
            fields[key] = _number(key, value)
        elif key == "base" and sep:
            fields[key] = value.strip()
        else:
            raise ValueError(f"LoRA: unknown setting {item!r} in {text!r}; give r=, alpha=, dropout=, base=, targets=")
    if targets:
        fields["targets"] = tuple(targets)
    return LoRA(**fields)


def _number(key: str, value: str) -> int | float:
    try:
        return int(value) if key == "rank" else float(value)
    except ValueError:
        raise ValueError(f"LoRA: {key}={value!r} is not a number") from None


def as_lora(value: LoRA | str | Mapping[str, Any]) -> LoRA:
    """A `LoRA` from itself, its text (`parse_lora`) or its record (a dict)."""
    if isinstance(value, LoRA):
        return value
    if isinstance(value, str):
        return parse_lora(value)
    if isinstance(value, Mapping):
        # The same settings as the text form, under the same names: "r" or "rank", and one pattern or several.
        fields = {{"r": "rank"}.get(str(k), str(k)): v for k, v in value.items()}
        unknown = sorted(set(fields) - {"rank", "alpha", "dropout", "targets", "base"})
        if unknown:
            raise ValueError(
                f"LoRA: unknown setting {unknown[0]!r} in {dict(value)!r}; give rank, alpha, dropout, targets, base"
            )
        return LoRA(**fields)  # LoRA takes a single pattern as one target, as the text form does
    raise TypeError(f"LoRA settings must be a jaxnn.lora.LoRA, its text or a dict, got {type(value).__name__}")


def _weights(flat: Mapping[str, Any]) -> list[str]:
    """The dotted names ("....w") of the 2-D (or stacked) weights in `flat`, stored plain or quantised."""
    plain = [name for name, leaf in flat.items() if name.rsplit(".", 1)[-1] == "w" and np.ndim(leaf) >= 2]
    return plain + [name[: -len("_q")] for name in flat if name.endswith(".w_q")]


def target_names(params: Any, targets: Iterable[str]) -> list[str]:
    """The dotted names of the weights `targets` select (a quantised weight by its plain name, "....w"); none is
    a ValueError showing the names there are."""
    targets = tuple(targets)
    weights = _weights(flatten(params))
    names = [name for name in weights if matches(name, targets)]
    if not names:
        raise ValueError(
            f"LoRA: no Dense weight matches targets {list(targets)}; the weights are named like {weights[:4]}"
        )
    return names


def has_adapters(params: Any) -> bool:
    """Whether `params` hold LoRA adapters anywhere."""
    return any(name.endswith(".lora_a") for name in flatten(params))


def add_adapters(params: Any, lora: LoRA, key: jax.Array) -> Any:
    """`params` with adapters beside every weight `lora.targets` selects: `lora_a` ~ N(0, 1/in), `lora_b` = 0
    (the model's outputs are unchanged until training moves `b`), `lora_scale` = alpha / rank; float32."""
    if has_adapters(params):
        raise ValueError("LoRA: these params already hold adapters; merge them first (jaxnn.lora.merge)")
    flat = dict(flatten(params))
    for i, name in enumerate(target_names(params, lora.targets)):
        base = name[: -len(".w")]
        *stack, fan_in, fan_out = _weight_shape(flat, base) or ()
        a = jax.random.normal(jax.random.fold_in(key, i), (*stack, fan_in, lora.rank), jnp.float32)
        flat[f"{base}.lora_a"] = a / math.sqrt(fan_in)
        flat[f"{base}.lora_b"] = jnp.zeros((*stack, lora.rank, fan_out), jnp.float32)
        flat[f"{base}.lora_scale"] = jnp.full(tuple(stack), lora.scale, jnp.float32)
    return unflatten(flat)


def quantize_base(params: Any, lora: LoRA) -> Any:
    """`params` with the weights `lora.targets` select stored as `lora.base` (int8 or nf4 codes and scales);
    unchanged when `lora.base` is None. Adapters already beside them stay as they are."""
    if lora.base is None:
        return params
    flat = flatten(params)
    plain = [name for name in target_names(params, lora.targets) if name in flat]  # not those stored already
    return quantized.quantize_params(params, plain, lora.base)


def adapter_labels(params: Any) -> Any:
    """ "adapter" for every `lora_a`/`lora_b`, "base" for everything else (`lora_scale` included: it is fixed)."""
    flat = {name: ("adapter" if name.rsplit(".", 1)[-1] in TRAINED else "base") for name in flatten(params)}
    return jax.tree.unflatten(jax.tree.structure(params), list(flat.values()))


def train_adapters_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on the adapters; the base gets zero updates and no optimizer state (its weight gradients are then
    unused, and XLA does not compute them)."""
    return optax.multi_transform({"adapter": tx, "base": optax.set_to_zero()}, adapter_labels)


def merge(params: Any) -> Any:
    """`params` with every adapter folded into its weight (`w + scale * a @ b`, in float32, stored in `w`'s
    dtype) and the adapter arrays removed: a plain model that exports anywhere. Without adapters, `params`."""
    params = quantized.dequantize_params(params)
    if not has_adapters(params):
        return params
    flat = dict(flatten(params))
    for name in [n for n in flat if n.endswith(".lora_a")]:
        base = name[: -len(".lora_a")]
        a, b, scale = (flat.pop(f"{base}.{k}") for k in ADAPTER_KEYS)
        w = flat[f"{base}.w"]
        delta = jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        merged = jnp.asarray(w, jnp.float32) + jnp.asarray(scale, jnp.float32)[..., None, None] * delta
        flat[f"{base}.w"] = merged.astype(jnp.result_type(w))
    return unflatten(flat)


def adapters(params: Any) -> dict[str, Any]:
    """The adapter arrays alone, by dotted name."""
    return {name: leaf for name, leaf in flatten(params).items() if name.rsplit(".", 1)[-1] in ADAPTER_KEYS}


def base_digest(params: Any, names: Any) -> str:
    """SHA-256 of the base weights the adapters `names` (dotted adapter names) attach to: each weight's name, dtype,
    shape and bytes, in name order. What an adapter file records of its base, so that another base of the same
    shapes is noticed."""
    import hashlib

    flat = dict(flatten(params))
    digest = hashlib.sha256()
    for stem in sorted({name.rsplit(".", 1)[0] for name in names}):
        for weight in (f"{stem}.w",) if f"{stem}.w" in flat else (f"{stem}.w_q", f"{stem}.w_scale"):
            array = np.ascontiguousarray(np.asarray(flat[weight]))
            digest.update(f"{weight}|{array.dtype}|{array.shape}|".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def save_adapters(path: str | os.PathLike, params: Any, lora: LoRA) -> str:
    """Writes the adapters of `params` (nothing of the base), their settings and a digest of the base weights they
    attach to (`base_digest`) as one safetensors file; returns its path. Load them onto the same base with
    `load_adapters`."""
    from safetensors.numpy import save

    from jaxnn._src.storage import write_bytes_atomic

    arrays = {name: np.array(leaf, order="C") for name, leaf in adapters(params).items()}  # 0-d stays 0-d
    if not arrays:
        raise ValueError("save_adapters: the params hold no LoRA adapters")
    meta = {"format": FORMAT, "version": str(VERSION), "lora": json.dumps(lora.record())}
    meta["base_sha256"] = base_digest(params, arrays)
    path = os.fspath(path)
    write_bytes_atomic(path, save(arrays, metadata=meta))
    return path


def load_adapters(path: str | os.PathLike, params: Any, *, check_base: bool = True) -> tuple[Any, LoRA]:
    """Returns `(params_with_adapters, lora)`: `params` (a base without adapters) with the adapters of a
    `save_adapters` file, and their settings. An adapter whose weight is missing from `params`, or of another
    shape, is a ValueError naming it; so is a base whose adapted weights differ from those the file recorded
    (another checkpoint of the same shapes), unless `check_base=False` (a file written before the digest was
    recorded loads unchecked)."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), "numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a jaxnn LoRA adapter file (no {FORMAT!r} format in its header)")
            arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' reader raises its own error for every kind of damage
        detail = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a readable adapter file ({detail})") from None
    lora = as_lora(json.loads(meta["lora"]))
    if has_adapters(params):
        raise ValueError("load_adapters: these params already hold adapters")
    if lora.base is not None and not quantized.is_quantized(params):
        params = quantize_base(params, lora)  # the base stored as the adapters were trained on it
    flat = dict(flatten(params))
    for name, array in arrays.items():
        shape = _weight_shape(flat, name.rsplit(".", 1)[0])
        if shape is None or not _fits(name.rsplit(".", 1)[-1], array.shape, shape):
            raise ValueError(f"{path}: adapter {name} has no matching weight in the params (another base model?)")
        flat[name] = jnp.asarray(array)
    recorded = meta.get("base_sha256")
    if check_base and recorded and base_digest(params, arrays) != recorded:
        raise ValueError(
            f"{path}: these adapters were trained on another base (the weights they attach to differ from the "
            f"recorded digest {recorded[:12]}); load the base they were trained on, or pass check_base=False"
        )
    return unflatten(flat), lora


def _weight_shape(flat: dict[str, Any], stem: str) -> tuple[int, ...] | None:
    """The (stack..., in, out) shape of the weight at `stem`, stored plain or quantised; None if there is none."""
    if f"{stem}.w" in flat:
        return tuple(np.shape(flat[f"{stem}.w"]))
    return quantized.weight_shape(flat[f"{stem}.w_q"]) if f"{stem}.w_q" in flat else None


def _fits(kind: str, shape: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """Whether an adapter array of `shape` belongs beside a weight of shape `weight` (stack..., in, out)."""
    stack = weight[:-2]
    if kind == "lora_a":
        return len(shape) == len(weight) and shape[:-1] == weight[:-1]
    if kind == "lora_b":
        return len(shape) == len(weight) and shape[:-2] == stack and shape[-1] == weight[-1]
    return shape == stack


def frozen_base(params: Any) -> Any:
    """`params` with a stop-gradient on everything but the adapters: differentiated, the base weights get
    symbolic zeros, so the compiled step has no weight-gradient products for them (a third of a full step's)."""
    labels = adapter_labels(params)

    def frozen(path, p, label):  # an fp8 amax history gets its update through the gradient: never stopped
        return p if label == "adapter" or fp8.is_history(path) else jax.lax.stop_gradient(p)

    return jax.tree_util.tree_map_with_path(frozen, params, labels)


def lora_model(model: Layer, lora: LoRA) -> Layer:
    """`model` for training adapters: gradients flow into the adapters alone (`frozen_base`), and training
    applies (train=True with a key) drop the adapters' inputs at `lora.dropout`. Its params are the model's
    with adapters; its outputs are the model's."""

    def apply(params, x, *, key=None, train=False, **kwargs):
        params = frozen_base(params)
        if not train or key is None or lora.dropout == 0:
            return model.apply(params, x, key=key, train=train, **kwargs)
        with adapter_dropout(lora.dropout, jax.random.fold_in(key, 0x10AA)):
            return model.apply(params, x, key=key, train=train, **kwargs)

    return model._replace(apply=apply)


def with_adapters(model: Layer, lora: LoRA) -> Layer:
    """`lora_model(model, lora)` whose init adds adapters to its fresh params: for building a LoRA model from
    scratch, e.g. to size it. `fit(..., lora=)` adds the adapters to the params it starts from instead."""

    def init(key, in_shape):
        out_shape, params = model.init(key, in_shape)
        return out_shape, add_adapters(params, lora, jax.random.fold_in(key, 0x10AA))

    return lora_model(model, lora)._replace(init=init)


def unused_adapters(apply: Any, params: Any, x: Any) -> list[str]:
    """The adapters (by weight name) that `apply(params, x)` (e.g. a model's forward pass) never reads: weights
    matched by a pattern but used by a layer other than Dense (a convolution, a custom layer), whose adapters
    would never train. Found from the traced program, without running it; `x` may be a ShapeDtypeStruct."""
    leaves, _ = jax.tree_util.tree_flatten(params)
    names = list(flatten(params))
    jaxpr = jax.make_jaxpr(apply)(params, x).jaxpr
    used = used_inputs(jaxpr)  # the params' leaves are the program's first inputs
    assert len(leaves) == len(names) <= len(jaxpr.invars)
    return [
        name[: -len(".lora_a")] + ".w" for i, name in enumerate(names) if name.endswith(".lora_a") and i not in used
    ]


__all__ = [
    "DEFAULT_TARGETS",
    "LoRA",
    "adapter_labels",
    "adapters",
    "add_adapters",
    "as_lora",
    "base_digest",
    "frozen_base",
    "has_adapters",
    "load_adapters",
    "lora_model",
    "merge",
    "parse_lora",
    "quantize_base",
    "save_adapters",
    "target_names",
    "train_adapters_only",
    "unused_adapters",
    "with_adapters",
]
