"""LoRA adapters in PEFT's layout, both ways: what `peft.PeftModel.from_pretrained` (and vLLM's LoRA loader) read.

    save_peft("my-adapter", cfg, params, settings)           # adapter_config.json + adapter_model.safetensors
    params, settings = load_peft("their-adapter", cfg, base)  # a PEFT folder onto a jaxnn GPT's params

A jaxnn adapter sits on one jaxnn weight; the checkpoint rules of `jaxnn.interop.hf` say which transformers
modules that weight is. A fused weight (GPT-2's `c_attn` is one module; Llama's q, k and v are three, fused into
jaxnn's `qkv`, or `kv` beside `q` under grouped heads) gets one PEFT adapter per module: each takes the shared `a`
and its own columns of `b`, so every module's update is the jaxnn update's part, exactly. The other way, PEFT's
q, k and v adapters with different `A` matrices become one jaxnn adapter of rank 3r: `a` stacks the three `A`s and
`b` is block-diagonal, which is the same update. PEFT's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) becomes
`lora_scale`. Not read: DoRA, per-module ranks or alphas, adapters on biases or embeddings (a one-line refusal).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxnn._src.pytree import flatten, unflatten
from jaxnn.interop.hf import rules_for
from jaxnn.interop.tensors import Rule
from jaxnn.lora import LoRA, has_adapters
from jaxnn.models.gpt import GPTConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: the wrapped model's module path, then lora_A / lora_B (the adapter's own name left out).
PREFIX = "base_model.model."


def _rules_by_weight(cfg: GPTConfig) -> dict[str, Rule]:
    """jaxnn weight name (dotted) -> the rule that holds it in a transformers checkpoint."""
    return {".".join(rule.target): rule for rule in rules_for(cfg) if rule.target[-1] == "w"}


def _keeps_layout(rule: Rule, out: int) -> bool:
    """Whether the checkpoint stores this weight (in, out) as jaxnn does (GPT-2's Conv1D), not (out, in)."""
    return all(piece.shape[0] == 1 for piece in rule.from_jaxnn(np.zeros((1, out), np.float32)))


def _module(source: str) -> str:
    return source.removesuffix(".weight")


def peft_tensors(cfg: GPTConfig, params: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(PEFT's tensors by name, the adapter_config.json fields they need: r, lora_alpha, target_modules,
    fan_in_fan_out) for the adapters in `params` of a jaxnn GPT of config `cfg`."""
    flat = flatten(params)
    rules = _rules_by_weight(cfg)
    tensors: dict[str, np.ndarray] = {}
    ranks, scales, conv1d = set(), set(), False
    for name in sorted(n for n in flat if n.endswith(".lora_a")):
        base = name.removesuffix(".lora_a")
        rule = rules.get(f"{base}.w")
        if rule is None:
            raise ValueError(f"{base}: an adapter on a weight that a transformers checkpoint does not hold")
        a, b = (np.asarray(flat[f"{base}.{k}"], np.float32) for k in ("lora_a", "lora_b"))
        if a.ndim != 2:
            raise ValueError(f"{base}: stacked adapters (scan_layers=True) have no PEFT layout; unroll the blocks")
        ranks.add(a.shape[1])
        scales.add(float(np.asarray(flat[f"{base}.lora_scale"])))
        keeps = _keeps_layout(rule, b.shape[1])
        conv1d |= keeps
        pieces = rule.from_jaxnn(b)  # b as a weight of `in` = r: each module's columns, in its own layout
        for source, piece in zip(rule.sources, pieces, strict=True):
            module = PREFIX + _module(source)
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(piece.T if keeps else piece)
    if not tensors:
        raise ValueError("the params hold no LoRA adapters")
    if len(ranks) > 1 or len(scales) > 1:
        raise ValueError(f"adapters of ranks {sorted(ranks)} and scales {sorted(scales)}: PEFT's file takes one each")
    (rank,), (scale,) = ranks, scales
    modules = sorted({k.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for k in tensors})
    return tensors, {"r": rank, "lora_alpha": scale * rank, "target_modules": modules, "fan_in_fan_out": conv1d}


def save_peft(
    folder: str | os.PathLike,
    cfg: GPTConfig,
    params: Any,
    lora: LoRA,
    *,
    base_model: str | None = None,
    source: str | None = None,
) -> str:
    """Writes the adapters in `params` as a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) for
    the transformers checkpoint `jaxnn.interop.hf.save_hf` writes of the same base (`base_model`: its name or path,
    recorded as PEFT's `base_model_name_or_path`). Written whole, as `save_hf` writes (`jaxnn._src.folders`)."""
    from safetensors.numpy import save_file

    from jaxnn._src.folders import write_folder

    tensors, fields = peft_tensors(cfg, params)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "bias": "none",
        "lora_dropout": lora.dropout,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        **fields,
    }

    def fill(staging: pathlib.Path) -> None:
        save_file(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))

    return os.fspath(write_folder(folder, fill, {"format": "peft lora adapters", "source": source}))


def _read(folder: pathlib.Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{folder}: not a PEFT adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads(config_path.read_text())
    refused = {
        "peft_type": config.get("peft_type") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    if any(refused.values()):
        wrong = ", ".join(f"{k}={config.get(k)!r}" for k, bad in refused.items() if bad)
        raise ValueError(f"{config_path}: jaxnn reads plain LoRA adapters on linear weights, not {wrong}")
    return config, load_file(weights_path)


def load_peft(folder: str | os.PathLike, cfg: GPTConfig, params: Any) -> tuple[Any, LoRA]:
    """Returns `(params_with_adapters, lora)`: a PEFT LoRA folder's adapters put onto `params`, a jaxnn GPT of config
    `cfg` without adapters (e.g. `load_hf` of the base the adapters were trained on). A module of the folder that
    the GPT does not have is a ValueError naming it."""
    folder = pathlib.Path(folder)
    config, tensors = _read(folder)
    if has_adapters(params):
        raise ValueError("load_peft: these params already hold adapters")
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    by_source = {source: rule for rule in _rules_by_weight(cfg).values() for source in rule.sources}
    found: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for key, array in tensors.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        rule = by_source.get(f"{module}.weight")
        if rule is None or kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{folder / WEIGHTS_FILE}: {key} is not a LoRA weight of a module this GPT has")
        found.setdefault(".".join(rule.target), {}).setdefault(module, {})[kind[0]] = np.asarray(array, np.float32)
    rules = _rules_by_weight(cfg)
    flat = dict(flatten(params))
    for weight, modules in found.items():
        a, b = _fused(rules[weight], modules, flat[weight].shape)
        base = weight.removesuffix(".w")
        flat[f"{base}.lora_a"], flat[f"{base}.lora_b"] = jnp.asarray(a), jnp.asarray(b)
        flat[f"{base}.lora_scale"] = jnp.asarray(scale, jnp.float32)
    lora = LoRA(
        rank=rank, alpha=scale * rank, targets=tuple(sorted(found)), dropout=float(config.get("lora_dropout", 0))
    )
    return unflatten(flat), lora


def _fused(rule: Rule, modules: dict[str, dict[str, np.ndarray]], shape: tuple[int, ...]) -> tuple[Any, Any]:
    """One jaxnn adapter (a: (in, R), b: (R, out)) for the PEFT adapters on the modules of `rule` (a module with
    none gets a zero update): the shared `A` where every module's is the same, else the `A`s stacked and `b`
    block-diagonal."""
    names = [_module(s) for s in rule.sources]
    keeps = _keeps_layout(rule, shape[-1])
    widths = [p.shape[-1] if keeps else p.shape[0] for p in rule.from_jaxnn(np.zeros((1, shape[-1]), np.float32))]
    given = [modules[n]["A"] for n in names if n in modules]
    shared = all(np.array_equal(given[0], other) for other in given[1:])
    a_rows = [given[0]] if shared else given
    rank = sum(a.shape[0] for a in a_rows)
    pieces, offset = [], 0
    for name, width in zip(names, widths, strict=True):
        piece = np.zeros((width, rank), np.float32)  # (out_i, R): this module's rows of the update
        if name in modules:
            r = modules[name]["B"].shape[1]
            piece[:, offset : offset + r] = modules[name]["B"]
            offset += 0 if shared else r
        pieces.append(piece)
    b = rule.to_jaxnn(*[p.T if keeps else p for p in pieces])  # back to jaxnn's (R, out)
    return np.concatenate(a_rows, axis=0).T, b
