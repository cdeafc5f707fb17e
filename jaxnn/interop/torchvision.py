"""torchvision ResNet state dicts (resnet18/34/50 and any other stage sizes) in and out of
`jaxnn.models.imagenet_resnet`, whose layers are torchvision's one for one.

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


__all__ = [
    "batch_norm_rules",
    "conv_rule",
    "load_torchvision_resnet",
    "resnet_config_from_state_dict",
    "resnet_rules",
    "to_torchvision_state_dict",
]
