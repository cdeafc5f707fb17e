"""Hugging Face `transformers` checkpoint folders (config.json + model.safetensors) of GPT-2 and Llama models,
in and out of jaxnn's GPT family.

    cfg, params = load_hf("path/to/gpt2-folder")               # a jaxnn GPTConfig and its params
    logits = GPT(cfg).apply(params, ids)                         # equal to transformers' logits
    save_hf("out/", cfg, params)                                 # transformers' from_pretrained reads it back

Neither torch nor transformers is needed: the tensors are read and written as safetensors. The rules
(`gpt2_rules`, `llama_rules`) say which tensor becomes which jaxnn array; docs/bring-a-checkpoint.md has them as
tables. GPT-2's Conv1D weights are already (in, out), as jaxnn's Dense stores them; Llama's nn.Linear weights
are (out, in) and are transposed; both libraries rotate the first and second halves of each head, so rotary
embeddings need no permutation.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np

from jaxnn.interop.tensors import (
    Rule,
    TensorMismatchError,
    concatenated,
    from_jaxnn,
    read_tensors,
    same,
    to_jaxnn,
    transposed,
)
from jaxnn.models.gpt import GPT, GPTConfig

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
# transformers' names for the tanh-approximated GELU jaxnn's GPT uses.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# The weights files transformers' save_pretrained writes (a jaxnn run or export names its files otherwise).
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is (meant as) a transformers checkpoint folder: a config.json with a `model_type`, or
    transformers' weights files whatever state its config.json is in (`read_hf_config` then says what is
    wrong)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    if any(os.path.isfile(os.path.join(path, name)) for name in HF_WEIGHTS):
        return True
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's config.json as a dict; a missing, cut-short or foreign one is one TensorMismatchError."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise TensorMismatchError(
            f"{folder}: transformers weights without a config.json, which says what model they are; save the "
            "model with save_pretrained, which writes both"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as err:
        raise TensorMismatchError(f"{path}: not JSON ({err}); cut short or damaged?") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise TensorMismatchError(f"{path}: no model_type; not the config.json of a transformers model")
    return config


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """The jaxnn GPTConfig of a transformers GPT-2 or Llama config.json; a ValueError names a setting jaxnn's GPT
    does not model (another architecture, activation or rotary scaling)."""
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt2_config(hf)
        if kind == "llama":
            return _llama_config(hf)
    except KeyError as err:
        raise TensorMismatchError(f"a transformers {kind} config.json without {err.args[0]!r}") from None
    raise ValueError(f"model_type {kind!r}: jaxnn reads transformers checkpoints of {sorted(ARCHITECTURES)}")


def _gpt2_config(hf: dict[str, Any]) -> GPTConfig:
    if hf.get("activation_function", "gelu_new") not in _TANH_GELUS:
        raise ValueError(f"GPT-2 activation_function {hf['activation_function']!r}: jaxnn's GPT uses tanh-GELU")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head width) is not modelled")
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        seq_len=hf["n_positions"],
        d_model=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        mlp_hidden=hf.get("n_inner"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def _llama_config(hf: dict[str, Any]) -> GPTConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama hidden_act {hf['hidden_act']!r}: jaxnn's SwiGLU uses silu")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"Llama rope_type {kind!r}: only unscaled rotary embeddings are modelled")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError("Llama with biases in attention but not in the MLP (or the reverse) is not modelled")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        seq_len=hf.get("max_position_embeddings", 2048),
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=None if head_dim == d // heads else head_dim,
        position="rope",
        norm="rms",
        mlp="swiglu",
        mlp_hidden=hf["intermediate_size"],
        bias=bool(hf.get("attention_bias", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """The transformers config.json of a jaxnn GPTConfig: GPT-2 for learned positions, Llama for rotary ones.
    A ValueError names what the transformers class cannot hold."""
    if cfg.logits_bias and not cfg.tie_embeddings:
        raise ValueError(
            "the GPT has a bias on its logits (logits_bias=True), which transformers' GPT-2 and Llama heads do not "
            "have; train with logits_bias=false (the default for new GPTs) to export"
        )
    if cfg.position == "learned":
        if cfg.mlp != "gelu" or cfg.norm != "layer" or not cfg.bias or cfg.num_kv_heads not in (None, cfg.num_heads):
            raise ValueError("a GPT-2 checkpoint has a GELU MLP, LayerNorm, biases and one key/value head per head")
        return {
            "model_type": "gpt2",
            "architectures": [ARCHITECTURES["gpt2"]],
            "activation_function": "gelu_new",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.mlp_hidden,
            "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
        }
    if cfg.mlp != "swiglu" or cfg.norm != "rms":
        raise ValueError("a Llama checkpoint has a SwiGLU MLP and RMSNorm (mlp='swiglu', norm='rms')")
    return {
        "model_type": "llama",
        "architectures": [ARCHITECTURES["llama"]],
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        "head_dim": cfg.head_dim or cfg.d_model // cfg.num_heads,
        "intermediate_size": cfg.mlp_hidden or 4 * cfg.d_model,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_base, "rope_type": "default"},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _layout(cfg: GPTConfig) -> tuple[int, int]:
    """(index of the first block, index of the final norm) among the GPT's top-level layers."""
    if cfg.scan_layers:
        raise ValueError("checkpoint conversion needs the blocks unrolled (scan_layers=False)")
    first = 2 if cfg.position == "learned" else 1
    return first, first + cfg.num_layers


def _norm(source: str, target: tuple[str, ...], layer_norm: bool) -> list[Rule]:
    rules = [same(f"{source}.weight", (*target, "scale"))]
    return rules + [same(f"{source}.bias", (*target, "bias"))] if layer_norm else rules


def _dense(source: str, target: tuple[str, ...], bias: bool, *, torch_layout: bool) -> list[Rule]:
    weight = (
        transposed(f"{source}.weight", (*target, "w")) if torch_layout else same(f"{source}.weight", (*target, "w"))
    )
    return [weight, same(f"{source}.bias", (*target, "b"))] if bias else [weight]


def gpt2_rules(cfg: GPTConfig, prefix: str = "transformer.") -> list[Rule]:
    """transformers GPT2LMHeadModel tensors -> jaxnn GPT params (`prefix` "" for a bare GPT2Model)."""
    first, final = _layout(cfg)
    rules = [same(f"{prefix}wte.weight", ("0_embed", "table")), same(f"{prefix}wpe.weight", ("1_pos_embed", "table"))]
    for i in range(cfg.num_layers):
        src, blk = f"{prefix}h.{i}", f"{first + i}_block"
        rules += _norm(f"{src}.ln_1", (blk, "0_attn", "0_ln"), True)
        rules += _dense(f"{src}.attn.c_attn", (blk, "0_attn", "1_attention", "qkv"), True, torch_layout=False)
        rules += _dense(f"{src}.attn.c_proj", (blk, "0_attn", "1_attention", "out"), True, torch_layout=False)
        rules += _norm(f"{src}.ln_2", (blk, "1_mlp", "0_ln"), True)
        rules += _dense(f"{src}.mlp.c_fc", (blk, "1_mlp", "1_fc"), True, torch_layout=False)
        rules += _dense(f"{src}.mlp.c_proj", (blk, "1_mlp", "3_proj"), True, torch_layout=False)
    rules += _norm(f"{prefix}ln_f", (f"{final}_ln_f",), True)
    if not cfg.tie_embeddings:
        rules += [transposed("lm_head.weight", (f"{final + 1}_logits", "w"))]
    return rules


def llama_rules(cfg: GPTConfig) -> list[Rule]:
    """transformers LlamaForCausalLM tensors -> jaxnn GPT params. q, k and v become jaxnn's fused `qkv` when every
    head has its own key/value head, else `q` and a fused `kv`."""
    first, final = _layout(cfg)
    rules = [same("model.embed_tokens.weight", ("0_embed", "table"))]
    for i in range(cfg.num_layers):
        src, blk = f"model.layers.{i}", f"{first + i}_block"
        attn = (blk, "0_attn", "1_attention")
        qkv = tuple(f"{src}.self_attn.{p}_proj" for p in "qkv")
        rules += _norm(f"{src}.input_layernorm", (blk, "0_attn", "0_ln"), False)
        if (cfg.num_kv_heads or cfg.num_heads) == cfg.num_heads:
            rules += _joined(qkv, (*attn, "qkv"), cfg.bias)
        else:
            rules += _dense(qkv[0], (*attn, "q"), cfg.bias, torch_layout=True) + _joined(
                qkv[1:], (*attn, "kv"), cfg.bias
            )
        rules += _dense(f"{src}.self_attn.o_proj", (*attn, "out"), cfg.bias, torch_layout=True)
        rules += _norm(f"{src}.post_attention_layernorm", (blk, "1_mlp", "0_ln"), False)
        for part in ("gate", "up", "down"):
            rules += _dense(f"{src}.mlp.{part}_proj", (blk, "1_mlp", "1_swiglu", part), cfg.bias, torch_layout=True)
    rules += _norm("model.norm", (f"{final}_ln_f",), False)
    if not cfg.tie_embeddings:
        rules += [transposed("lm_head.weight", (f"{final + 1}_logits", "w"))]
    return rules


def _joined(sources: tuple[str, ...], target: tuple[str, ...], bias: bool) -> list[Rule]:
    weights = concatenated(tuple(f"{s}.weight" for s in sources), (*target, "w"), transpose=True)
    biases = [concatenated(tuple(f"{s}.bias" for s in sources), (*target, "b"), transpose=False)] if bias else []
    return [weights, *biases]


def rules_for(cfg: GPTConfig, tensors: dict[str, Any] | None = None) -> list[Rule]:
    """The rules of the architecture `cfg` describes (a GPT-2 folder's prefix read off `tensors`' names)."""
    if cfg.position == "learned":
        bare = tensors is not None and "wte.weight" in tensors
        return gpt2_rules(cfg, "" if bare else "transformer.")
    return llama_rules(cfg)


def _not_a_parameter(name: str) -> bool:
    """Buffers older transformers versions saved beside the weights, and the tied output matrix."""
    return name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))


def expected_params(cfg: GPTConfig) -> Any:
    """The shapes and dtypes of a GPT's params for `cfg`, without allocating them."""
    model = GPT(cfg)
    return jax.eval_shape(lambda key: model.init(key, (1, 1))[1], jax.random.key(0))


def load_hf(folder: str | os.PathLike, *, dtype: Any = None) -> tuple[GPTConfig, Any]:
    """The GPTConfig and params of a transformers GPT-2 or Llama folder (sharded ones too), as numpy arrays in
    `dtype` (None: float32; "bfloat16" keeps bf16 weights at half the memory). A TensorMismatchError names the
    first tensor that is missing, unexpected or of the wrong shape."""
    folder = os.fspath(folder)
    cfg = config_from_hf(read_hf_config(folder))
    tensors = read_tensors(folder)
    tied = cfg.tie_embeddings
    ignore = (lambda n: _not_a_parameter(n) or n == "lm_head.weight") if tied else _not_a_parameter
    params = to_jaxnn(tensors, rules_for(cfg, tensors), expected_params(cfg), source=folder, ignore=ignore, dtype=dtype)
    return cfg, params


def save_hf(
    folder: str | os.PathLike,
    cfg: GPTConfig,
    params: Any,
    *,
    dtype: Any = None,
    tokenizer_from: str | os.PathLike | None = None,
    source: str | None = None,
) -> str:
    """Writes `params` of a jaxnn GPT as a transformers folder (config.json, model.safetensors) that
    `AutoModelForCausalLM.from_pretrained` loads; returns the folder. `dtype`: the stored dtype (None: keep).
    `tokenizer_from`: a folder whose tokenizer files (tokenizer.json and its side files, the chat template in
    tokenizer_config.json among them) are copied beside the weights, so `AutoTokenizer` reads the vocabulary the
    model was trained on; the checkpoint's begin, end and padding ids (`interop.tokenizer.special_token_ids`) go
    into config.json and generation_config.json, so transformers' `generate()` stops at the end token as
    `jaxnn generate` does. LoRA adapters in `params` are merged into their weights first.

    The folder is written whole (`jaxnn._src.folders`): a new or empty folder, or an earlier export of the same
    `source` (e.g. the run it came from), which is replaced only once the new one is complete; a folder holding
    anything else is refused (`RunDirError`) and left as it was. A kill at any moment leaves the old or the new."""
    from safetensors.numpy import save_file

    from jaxnn._src.folders import write_folder
    from jaxnn.interop.tokenizer import GENERATION_FILE, SPECIAL_IDS, copy_tokenizer, json_object, special_token_ids
    from jaxnn.lora import merge

    params = merge(params)
    config = hf_config(cfg)
    tensors = from_jaxnn(params, rules_for(cfg), target=f"a transformers {config['model_type']} checkpoint")
    if dtype is not None:
        tensors = {name: np.asarray(t).astype(dtype) for name, t in tensors.items()}
    stored = {str(t.dtype) for t in tensors.values()}
    config["dtype"] = stored.pop() if len(stored) == 1 else "float32"
    ids = {} if tokenizer_from is None else special_token_ids(tokenizer_from, cfg.vocab_size)
    config.update(ids)
    generation = None
    if ids:  # the source's generation settings (sampling defaults and all), with the ids this model can emit
        settings = json_object(pathlib.Path(tokenizer_from) / GENERATION_FILE)  # type: ignore[arg-type]
        generation = {**{k: v for k, v in settings.items() if k not in SPECIAL_IDS}, **ids}

    def fill(staging: Any) -> None:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, staging / "model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
        if tokenizer_from is not None:
            copy_tokenizer(tokenizer_from, staging, subdir="")
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        if generation is not None:
            (staging / GENERATION_FILE).write_text(json.dumps(generation, indent=2))
        elif (staging / GENERATION_FILE).exists():  # a source file whose ids this model cannot emit
            (staging / GENERATION_FILE).unlink()

    return os.fspath(write_folder(folder, fill, {"format": "transformers", "source": source}))


__all__ = [
    "ARCHITECTURES",
    "TensorMismatchError",
    "config_from_hf",
    "expected_params",
    "gpt2_rules",
    "hf_config",
    "is_hf_folder",
    "llama_rules",
    "load_hf",
    "read_hf_config",
    "rules_for",
    "save_hf",
]
