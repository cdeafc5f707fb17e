"""Random image augmentation inside the jitted train step, on the device: crop, flips, colour jitter, mixup, cutmix.

The image operations are dm-pix's (`pip install 'jaxnn[augment]'`); jaxnn adds the batching (`jax.vmap` over the
examples), the keys and the mixed labels. Each example's key is `fold_in(fold_in(fold_in(train key, tag), step),
global example index)`, so an example's augmentation depends only on the run's seed, the step and its row in the
global batch: a resumed run sees the batches an uninterrupted one would, and 1 and 8 devices augment alike.

    aug = Augment(crop_pad=4, flip=True, mixup=0.2)
    jaxnn.fit(model, data, augment=aug)          # in the step; evaluation sees the images unaugmented

Mixup and cutmix pair row i with row i XOR 1 (0 with 1, 2 with 3, ...): a partner always lies on the same device
when each device holds an even number of rows, so every data-parallel form mixes the same pairs. They add
`batch["y_soft"]`, the mixed one-hot targets that `jaxnn.train.masked_classification_loss` trains against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

# Keeps augmentation's keys apart from dropout's `fold_in(key, step)`: "aug" in ASCII.
_AUGMENT_STREAM = 0x617567
NAMES = ("crop", "flip", "vflip", "brightness", "contrast", "saturation", "mixup", "cutmix")


def _pix() -> Any:
    # dm-pix is imported on first use: every other part of jaxnn runs without it.
    from jaxnn._src.optional import require

    return require("dm_pix", "on-device augmentation (jaxnn.augment)")


@dataclasses.dataclass(frozen=True)
class Augment:
    """Which random augmentations the train step applies to `batch["x"]` (B, H, W, C), in this order.

    crop_pad: zero-pad by this many pixels on every side, then crop back to H x W at a uniform random offset;
      "auto" (a bare `crop`) pads an eighth of the image's height (4 pixels of 32, 1 of the 8x8 digits), since a
      fixed 4 pixels would shift a small image by half its width.
    flip / vflip: mirror left-right / upside-down with probability 1/2.
    brightness: add a uniform delta in [-b, b); contrast, saturation: scale by a uniform factor in [1-c, 1+c)
      (dm-pix's definitions; saturation wants 3-channel RGB in [0, 1]).
    mixup / cutmix: the Beta(alpha, alpha) concentration (0 = off); with both, each example takes one at random.
    num_classes: the classes of the mixed one-hot targets; `fit` fills it in from the model's output.
    """

    crop_pad: int | str = 0
    flip: bool = False
    vflip: bool = False
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if self.crop_pad != "auto" and (
            not isinstance(self.crop_pad, int) or isinstance(self.crop_pad, bool) or self.crop_pad < 0
        ):
            raise ValueError(f"Augment: crop_pad must be a non-negative integer or 'auto', got {self.crop_pad!r}")
        for name in ("brightness", "contrast", "saturation", "mixup", "cutmix"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (name in ("contrast", "saturation") and value > 1)
            ):
                limit = " at most 1" if name in ("contrast", "saturation") else ""
                raise ValueError(f"Augment: {name} must be a number >= 0{limit}, got {value!r}")

    @property
    def mixes(self) -> bool:
        """Whether the targets become mixed (`y_soft`)."""
        return bool(self.mixup or self.cutmix)

    @property
    def transforms_images(self) -> bool:
        """Whether any per-image operation (crop, flips, colour jitter) is on."""
        return bool(self.crop_pad or self.flip or self.vflip or self.brightness or self.contrast or self.saturation)

    def check_available(self) -> None:
        """Raises ImportError in one line, naming the extra, when an image operation is on and dm-pix is missing:
        before tracing, where jax would add its own lines to the message."""
        if self.transforms_images:
            _pix()

    def record(self) -> dict:
        """The settings as JSON, for the run's record: a resume with other augmentation is refused."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "num_classes"}


def parse_augment(text: str) -> Augment:
    """`Augment` from the command line's text: `"crop,flip,brightness=0.2,mixup=0.2"`.

    A bare name takes its usual value: crop an eighth of the image's height ("auto": 4 pixels of 32, the usual
    CIFAR pad), brightness 0.2, contrast and saturation 0.4 (torchvision's ColorJitter examples), mixup 0.2 and
    cutmix 1.0 (the values of their papers' ImageNet runs)."""
    defaults = {"crop": 4, "brightness": 0.2, "contrast": 0.4, "saturation": 0.4, "mixup": 0.2, "cutmix": 1.0}
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in NAMES:
            raise ValueError(f"augment: unknown {name!r} in {text!r}; choose from {', '.join(NAMES)}")
        if name in ("flip", "vflip"):
            if value:
                raise ValueError(f"augment: {name} takes no value, got {part!r}")
            fields[name] = True
            continue
        if name == "crop" and value in ("", "auto"):
            fields["crop_pad"] = "auto"
            continue
        try:
            number = float(value) if value else float(defaults[name])
        except ValueError:
            raise ValueError(f"augment: {name} wants a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"augment: {name} wants a finite number, got {value!r}")
        if name == "crop":
            if number != int(number):
                raise ValueError(f"augment: crop wants a whole number of pixels, got {value!r}")
            fields["crop_pad"] = int(number)
        else:
            fields[name] = number
    return Augment(**fields)


def as_augment(value: Augment | str) -> Augment:
    """An `Augment` from itself or its text (`parse_augment`): where a run starts, so the run reads no text."""
    if isinstance(value, Augment):
        return value
    if isinstance(value, str):
        return parse_augment(value)
    raise TypeError(f"augment must be a jaxnn.augment.Augment or its text, got {type(value).__name__}")


def example_keys(key: jax.Array, step: jax.Array, rows: int, offset: Any = 0) -> jax.Array:
    """One key per row: rows `offset .. offset+rows-1` of the global batch at `step`."""
    base = jax.random.fold_in(jax.random.fold_in(key, _AUGMENT_STREAM), step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(offset + jnp.arange(rows))


def crop_pad_for(crop_pad: int | str, height: int) -> int:
    """The pixels a crop pads: `crop_pad` itself, or for "auto" an eighth of the image's height (at least 1)."""
    return max(1, round(height / 8)) if crop_pad == "auto" else int(crop_pad)


def augment_image(aug: Augment, key: jax.Array, x_HWC: jax.Array) -> jax.Array:
    """One image's random crop, flips and colour jitter under `key` (vmap it for a batch)."""
    pix = _pix()
    k_crop, k_flip, k_vflip, k_bright, k_contrast, k_sat = jax.random.split(key, 6)
    if aug.crop_pad:
        p = crop_pad_for(aug.crop_pad, x_HWC.shape[0])
        padded = jnp.pad(x_HWC, ((p, p), (p, p), (0, 0)))
        x_HWC = pix.random_crop(k_crop, padded, x_HWC.shape)
    if aug.flip:
        x_HWC = pix.random_flip_left_right(k_flip, x_HWC)
    if aug.vflip:
        x_HWC = pix.random_flip_up_down(k_vflip, x_HWC)
    if aug.brightness:
        x_HWC = pix.random_brightness(k_bright, x_HWC, aug.brightness)
    if aug.contrast:
        x_HWC = pix.random_contrast(k_contrast, x_HWC, 1 - aug.contrast, 1 + aug.contrast)
    if aug.saturation:
        x_HWC = pix.random_saturation(k_sat, x_HWC, 1 - aug.saturation, 1 + aug.saturation)
    return x_HWC


def _cutmix_mask(key: jax.Array, lam: jax.Array, H: int, W: int) -> tuple[jax.Array, jax.Array]:
    """A box of about (1 - lam) of the image at a uniform centre, clipped to it: (mask HxW1, kept fraction)."""
    ky, kx = jax.random.split(key)
    cut = jnp.sqrt(1.0 - lam)
    cy, cx = jax.random.uniform(ky) * H, jax.random.uniform(kx) * W
    y0, y1 = jnp.clip(cy - cut * H / 2, 0, H), jnp.clip(cy + cut * H / 2, 0, H)
    x0, x1 = jnp.clip(cx - cut * W / 2, 0, W), jnp.clip(cx + cut * W / 2, 0, W)
    y0, y1, x0, x1 = (jnp.round(v) for v in (y0, y1, x0, x1))
    rows, cols = jnp.arange(H)[:, None], jnp.arange(W)[None, :]
    inside = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
    return inside[:, :, None], 1.0 - (y1 - y0) * (x1 - x0) / (H * W)


def _mix(aug: Augment, keys: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mixup/cutmix of each row with its partner (row XOR 1); the one-hot targets mixed in the same proportion."""
    if aug.num_classes is None:
        raise ValueError("Augment: mixup and cutmix need num_classes (fit fills it in from the model's output)")
    B, H, W = x.shape[:3]
    if B % 2:
        raise ValueError(f"Augment: mixup and cutmix pair rows, so each device needs an even number of rows, got {B}")
    partner = jnp.arange(B) ^ 1
    x2, y2 = x[partner], y[partner]

    def one(key, xa, xb):
        k_lam, k_box, k_pick = jax.random.split(key, 3)
        use_cut = jnp.asarray(bool(aug.cutmix))
        if aug.mixup and aug.cutmix:  # each example takes one of the two at random
            use_cut = jax.random.bernoulli(k_pick)
        alpha = jnp.where(use_cut, aug.cutmix, aug.mixup)
        lam = jax.random.beta(k_lam, alpha, alpha)
        inside, kept = _cutmix_mask(k_box, lam, H, W)
        mixed = jnp.where(use_cut, jnp.where(inside, xb, xa), lam * xa + (1 - lam) * xb)
        return mixed.astype(xa.dtype), jnp.where(use_cut, kept, lam)

    mixed, lam = jax.vmap(one)(keys, x, x2)
    one_hot = jax.nn.one_hot(y, aug.num_classes, dtype=jnp.float32)
    one_hot2 = jax.nn.one_hot(y2, aug.num_classes, dtype=jnp.float32)
    return mixed, lam[:, None] * one_hot + (1 - lam[:, None]) * one_hot2


def augment_batch(aug: Augment, batch: dict, key: jax.Array, step: Any, offset: Any = 0) -> dict:
    """`batch` with `x` augmented per example (keys from `example_keys`) and, when mixing, `y_soft` added.

    `offset` is the global index of the batch's first row (a device's shard starts past the devices before it)."""
    aug.check_available()
    x = batch["x"]
    if jnp.ndim(x) != 4:
        raise ValueError(f"Augment: wants images (batch, height, width, channels), got x of shape {jnp.shape(x)}")
    if aug.saturation and x.shape[-1] != 3:
        raise ValueError(f"Augment: saturation wants RGB images (3 channels), got {x.shape[-1]}")
    keys = example_keys(key, step, x.shape[0], offset)
    image_keys, mix_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
    out = dict(batch)
    out["x"] = jax.vmap(lambda k, im: augment_image(aug, k, im))(image_keys, x) if aug.transforms_images else x
    if aug.mixes:
        if "y" not in batch:
            raise ValueError("Augment: mixup and cutmix mix the labels, but the batch has no 'y'")
        out["x"], out["y_soft"] = _mix(aug, mix_keys, out["x"], batch["y"])
    return out


def normalise(
    x_BHWC: jax.Array, scale: float, mean: Sequence[float] | jax.Array, std: Sequence[float] | jax.Array
) -> jax.Array:
    """float32 `(x / scale - mean) / std` per channel on the device: `jaxnn.data.preprocess.normalise`'s twin,
    for a step or model that receives the raw (e.g. uint8, 4x fewer bytes to copy) images."""
    # Explicit ranks: a program run with jax_numpy_rank_promotion="raise" refuses (C,) against (B, H, W, C).
    per_channel = (1,) * (x_BHWC.ndim - 1) + (-1,)
    mean_C = jnp.asarray(mean, jnp.float32).reshape(per_channel)
    inv_std_C = 1.0 / jnp.asarray(std, jnp.float32).reshape(per_channel)
    return (x_BHWC.astype(jnp.float32) * (1.0 / scale) - mean_C) * inv_std_C


__all__ = [
    "NAMES",
    "Augment",
    "as_augment",
    "augment_batch",
    "augment_image",
    "example_keys",
    "normalise",
    "parse_augment",
]
