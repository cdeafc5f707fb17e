"""torchvision ResNet state dicts (resnet18/34/50 and any other stage sizes) in and out of
`jaxnn.models.imagenet_resnet`, and VisionTransformer ones (vit_b_16, vit_l_16, ...) in and out of
`jaxnn.models.vit`: both have torchvision's layers one for one.

    params, state = load_torchvision_resnet("resnet50.pth")          # the config read off the tensor names
    logits = ImageNetResNet(cfg).apply(params, images_NHWC, state=state)[0]
    tensors = to_torchvision_state_dict(params, state, cfg)
    torch_model.load_state_dict({name: torch.from_numpy(array) for name, array in tensors.items()})

What goes where: convolution weights (out, in, kh, kw) are jaxnn's HWIO (kh, kw, in, out); a BatchNorm's weight
and bias are its params `scale` and `bias`, its running_mean and running_var are its *state* `mean` and `var`;
fc.weight (out, in) is the Dense `w` (in, out). `num_batches_tracked` has no jaxnn counterpart and is ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn.interop.tensors import (
    Path,
    Rule,
    TensorMismatchError,
    from_jaxnn,
    read_tensors,
    same,
    to_jaxnn,
    torch_to_numpy,
    transposed,
)
from jaxnn.layers import init_model
from jaxnn.layers.core import child_keys
from jaxnn.models.imagenet_resnet import ImageNetResNet, ImageNetResNetConfig, has_projection
from jaxnn.models.vit import ViT, ViTConfig

_BLOCK_KEY = re.compile(r"^layer(\d+)\.(\d+)\.")
# The params keys of a block's branch layers, as jaxnn.models.imagenet_resnet's serials number them (the ReLUs take
# the indices between); a change there shows as "nothing fills jaxnn's ..." in every conversion test.
_BODY_KEYS = {
    "basic": {"conv1": "0_conv1", "bn1": "1_bn1", "conv2": "3_conv2", "bn2": "4_bn2"},
    "bottleneck": {
        "conv1": "0_conv1",
        "bn1": "1_bn1",
        "conv2": "3_conv2",
        "bn2": "4_bn2",
        "conv3": "6_conv3",
        "bn3": "7_bn3",
    },
}
_DOWNSAMPLE_KEYS = {"downsample.0": "0_conv", "downsample.1": "1_bn"}


def conv_rule(source: str, target: Path) -> Rule:
    """A torch convolution weight (out, in, kh, kw) for a jaxnn Conv `w` (kh, kw, in, out)."""
    return Rule(
        (source,),
        target,
        lambda a: np.ascontiguousarray(a.transpose(2, 3, 1, 0)),
        lambda w: (np.ascontiguousarray(w.transpose(3, 2, 0, 1)),),
    )


def batch_norm_rules(prefix: str, target: Path) -> list[Rule]:
    """A torch BatchNorm2d: weight and bias into the params at `target`, the running statistics into the state."""
    return [
        same(f"{prefix}.weight", ("params", *target, "scale")),
        same(f"{prefix}.bias", ("params", *target, "bias")),
        same(f"{prefix}.running_mean", ("state", *target, "mean")),
        same(f"{prefix}.running_var", ("state", *target, "var")),
    ]


def _block_rules(cfg: ImageNetResNetConfig, prefix: str, target: Path, projects: bool) -> list[Rule]:
    rules: list[Rule] = []
    parts = {name: (*target, "0_body", key) for name, key in _BODY_KEYS[cfg.block].items()}
    if projects:
        parts.update({name: (*target, "1_shortcut", key) for name, key in _DOWNSAMPLE_KEYS.items()})
    for name, path in parts.items():
        if name.startswith("conv") or name == "downsample.0":
            rules.append(conv_rule(f"{prefix}.{name}.weight", ("params", *path, "w")))
        else:
            rules += batch_norm_rules(f"{prefix}.{name}", path)
    return rules


def resnet_rules(cfg: ImageNetResNetConfig) -> list[Rule]:
    """Every tensor of torchvision's ResNet state dict (num_batches_tracked aside) -> its jaxnn array, as paths
    from the root of `{"params": params, "state": state}`."""
    model = ImageNetResNet(cfg)
    keys = {layer.name: key for key, layer in zip(child_keys(model.children), model.children)}
    rules = [conv_rule("conv1.weight", ("params", keys["conv1"], "w")), *batch_norm_rules("bn1", (keys["bn1"],))]
    for i, blocks in enumerate(cfg.stage_sizes):
        for j in range(blocks):
            target = (keys[f"layer{i + 1}"], f"{j}_block")
            rules += _block_rules(cfg, f"layer{i + 1}.{j}", target, has_projection(cfg, i, j))
    return rules + [transposed("fc.weight", ("params", keys["fc"], "w")), same("fc.bias", ("params", keys["fc"], "b"))]


def resnet_config_from_state_dict(tensors: Mapping[str, Any]) -> ImageNetResNetConfig:
    """The config of the ResNet a torchvision state dict holds: stage sizes from the `layer<i>.<j>.` names, the
    block kind from whether blocks have a conv3, the width from conv1 and the classes from fc."""
    blocks: dict[int, set[int]] = {}
    for name in tensors:
        if match := _BLOCK_KEY.match(name):
            blocks.setdefault(int(match[1]), set()).add(int(match[2]))
    for needed in ("conv1.weight", "fc.weight"):
        if needed not in tensors:
            raise TensorMismatchError(
                f"not a torchvision ResNet state dict: no {needed!r} (found {len(tensors)} tensors)"
            )
    if sorted(blocks) != list(range(1, len(blocks) + 1)) or not blocks:
        raise TensorMismatchError(
            f"not a torchvision ResNet state dict: stages {sorted(blocks)}, not layer1, layer2, ..."
        )
    bottleneck = any(name.endswith(".conv3.weight") for name in tensors)
    return ImageNetResNetConfig(
        stage_sizes=tuple(len(blocks[i]) for i in sorted(blocks)),
        block="bottleneck" if bottleneck else "basic",
        width=int(np.shape(tensors["conv1.weight"])[0]),
        num_classes=int(np.shape(tensors["fc.weight"])[0]),
    )


def _as_arrays(checkpoint: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, np.ndarray], str]:
    if isinstance(checkpoint, (str, os.PathLike)):
        return read_tensors(checkpoint), os.fspath(checkpoint)
    arrays = {k: torch_to_numpy(v) if hasattr(v, "detach") else np.asarray(v) for k, v in checkpoint.items()}
    return arrays, "state dict"


def load_torchvision_resnet(
    checkpoint: str | os.PathLike | Mapping[str, Any], cfg: ImageNetResNetConfig | None = None, *, dtype: Any = None
) -> tuple[Any, Any]:
    """`(params, state)` for `ImageNetResNet(cfg)` from a torchvision ResNet checkpoint: a `.pth`/`.pt` file, a
    `.safetensors` file, or an in-memory state dict of torch tensors or arrays. `cfg` None reads it off the
    tensors (`resnet_config_from_state_dict`). `dtype` casts the params (None: float32); the BatchNorm statistics
    stay float32, the dtype BatchNorm computes them in. A missing or unexpected tensor, or a shape the model does
    not have, is one TensorMismatchError naming the first."""
    tensors, source = _as_arrays(checkpoint)
    cfg = cfg if cfg is not None else resnet_config_from_state_dict(tensors)
    model = ImageNetResNet(cfg)
    _, params_shape, state_shape = jax.eval_shape(lambda k: init_model(model, k, (1, 64, 64, 3)), jax.random.key(0))
    tree = to_jaxnn(
        tensors,
        resnet_rules(cfg),
        {"params": params_shape, "state": state_shape},
        source=source,
        ignore=lambda name: name.endswith("num_batches_tracked"),
    )
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype or jnp.float32), tree["params"])
    return params, jax.tree.map(jnp.asarray, tree["state"])


def to_torchvision_state_dict(params: Any, state: Any, cfg: ImageNetResNetConfig) -> dict[str, np.ndarray]:
    """The torchvision state dict of `ImageNetResNet(cfg)`'s params and state, as numpy arrays in the params'
    dtype (bfloat16 ones need a cast before `torch.from_numpy`), with the `num_batches_tracked` counters
    torchvision's BatchNorms hold (0: jaxnn does not count), so that `load_state_dict` takes it as it is."""
    # Copies: arrays of jax buffers are read-only, and torch.from_numpy warns about (and may write to) such arrays.
    out = {name: np.array(a) for name, a in from_jaxnn({"params": params, "state": state}, resnet_rules(cfg)).items()}
    for name in [n for n in out if n.endswith(".running_mean")]:
        out[name.removesuffix("running_mean") + "num_batches_tracked"] = np.array(0, np.int64)
    return out


# --- ViT ----------------------------------------------------------------------------------------------------------


def _vit_block_rules(i: int) -> list[Rule]:
    src, dst = f"encoder.layers.encoder_layer_{i}", ("3_encoder", f"{i + 1}_block")
    attn, mlp = (*dst, "0_attn"), (*dst, "1_mlp")
    return [
        same(f"{src}.ln_1.weight", (*attn, "0_ln_1", "scale")),
        same(f"{src}.ln_1.bias", (*attn, "0_ln_1", "bias")),
        # nn.MultiheadAttention's in_proj is q, k and v stacked (3D, D): jaxnn's fused qkv, transposed.
        transposed(f"{src}.self_attention.in_proj_weight", (*attn, "1_self_attention", "qkv", "w")),
        same(f"{src}.self_attention.in_proj_bias", (*attn, "1_self_attention", "qkv", "b")),
        transposed(f"{src}.self_attention.out_proj.weight", (*attn, "1_self_attention", "out", "w")),
        same(f"{src}.self_attention.out_proj.bias", (*attn, "1_self_attention", "out", "b")),
        same(f"{src}.ln_2.weight", (*mlp, "0_ln_2", "scale")),
        same(f"{src}.ln_2.bias", (*mlp, "0_ln_2", "bias")),
        transposed(f"{src}.mlp.0.weight", (*mlp, "1_fc1", "w")),
        same(f"{src}.mlp.0.bias", (*mlp, "1_fc1", "b")),
        transposed(f"{src}.mlp.3.weight", (*mlp, "4_fc2", "w")),
        same(f"{src}.mlp.3.bias", (*mlp, "4_fc2", "b")),
    ]


def vit_rules(cfg: ViTConfig) -> list[Rule]:
    """Every tensor of torchvision's VisionTransformer state dict -> its jaxnn `ViT(cfg)` param."""
    final = ("3_encoder", f"{cfg.num_layers + 1}_ln")
    return [
        conv_rule("conv_proj.weight", ("0_conv_proj", "w")),
        same("conv_proj.bias", ("0_conv_proj", "b")),
        same("class_token", ("2_embed", "class_token")),
        same("encoder.pos_embedding", ("2_embed", "pos_embedding")),
        *(rule for i in range(cfg.num_layers) for rule in _vit_block_rules(i)),
        same("encoder.ln.weight", (*final, "scale")),
        same("encoder.ln.bias", (*final, "bias")),
        transposed("heads.head.weight", ("5_head", "w")),
        same("heads.head.bias", ("5_head", "b")),
    ]


def vit_config_from_state_dict(tensors: Mapping[str, Any], *, head_dim: int = 64) -> ViTConfig:
    """The config of the ViT a torchvision state dict holds. The weights fix every size but the number of heads,
    which is the width over `head_dim` (64 in every published ViT: B/16 has 12 heads, L/16 16, H/14 20)."""
    for needed in ("conv_proj.weight", "encoder.pos_embedding", "heads.head.weight"):
        if needed not in tensors:
            raise TensorMismatchError(f"not a torchvision ViT state dict: no {needed!r} (found {len(tensors)} tensors)")
    hidden, _, patch, _ = np.shape(tensors["conv_proj.weight"])
    patches = np.shape(tensors["encoder.pos_embedding"])[1] - 1
    layers = len({name.split(".")[2] for name in tensors if name.startswith("encoder.layers.")})
    if hidden % head_dim:
        raise TensorMismatchError(f"ViT width {hidden} is not a multiple of head_dim {head_dim}; pass the config")
    return ViTConfig(
        image_size=int(round(patches**0.5)) * int(patch),
        patch_size=int(patch),
        num_layers=layers,
        num_heads=int(hidden) // head_dim,
        hidden_dim=int(hidden),
        mlp_dim=int(np.shape(tensors["encoder.layers.encoder_layer_0.mlp.0.weight"])[0]),
        num_classes=int(np.shape(tensors["heads.head.weight"])[0]),
    )


def load_torchvision_vit(
    checkpoint: str | os.PathLike | Mapping[str, Any], cfg: ViTConfig | None = None, *, dtype: Any = None
) -> Any:
    """The params of `ViT(cfg)` from a torchvision VisionTransformer checkpoint (a file or an in-memory state
    dict; `cfg` None reads it off the tensors, `vit_config_from_state_dict`), cast to `dtype` (None: float32)."""
    tensors, source = _as_arrays(checkpoint)
    cfg = cfg if cfg is not None else vit_config_from_state_dict(tensors)
    model = ViT(cfg)
    shape = (1, cfg.image_size, cfg.image_size, 3)
    expected = jax.eval_shape(lambda k: model.init(k, shape)[1], jax.random.key(0))
    params = to_jaxnn(tensors, vit_rules(cfg), expected, source=source)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype or jnp.float32), params)


def vit_to_torchvision_state_dict(params: Any, cfg: ViTConfig) -> dict[str, np.ndarray]:
    """The torchvision VisionTransformer state dict of `ViT(cfg)`'s params (numpy arrays in their dtype)."""
    return {name: np.array(a) for name, a in from_jaxnn(params, vit_rules(cfg)).items()}


__all__ = [
    "batch_norm_rules",
    "conv_rule",
    "load_torchvision_resnet",
    "load_torchvision_vit",
    "resnet_config_from_state_dict",
    "resnet_rules",
    "to_torchvision_state_dict",
    "vit_config_from_state_dict",
    "vit_rules",
    "vit_to_torchvision_state_dict",
]
