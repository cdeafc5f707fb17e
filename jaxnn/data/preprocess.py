"""Host-side numpy preprocessing: normalisation, random crop with padding, horizontal flip, random text windows.

Every random function takes an explicit `np.random.Generator`, so a batch is a pure function of its seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def normalise(
    x_BHWC: np.ndarray, scale: float, mean: Sequence[float] | np.ndarray, std: Sequence[float] | np.ndarray
) -> np.ndarray:
    """float32 `(x / scale - mean) / std` per channel."""
    mean_C = np.asarray(mean, np.float32)
    inv_std_C = 1.0 / np.asarray(std, np.float32)
    return (x_BHWC.astype(np.float32) * np.float32(1.0 / scale) - mean_C) * inv_std_C


def random_crop(x_BHWC: np.ndarray, rng: np.random.Generator, pad: int) -> np.ndarray:
    """Zero-pads each image by `pad` on every side and crops back to the original size at a random offset."""
    if pad <= 0:
        return x_BHWC
    B, H, W, C = x_BHWC.shape
    padded = np.pad(x_BHWC, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    # A strided view of every HxW window, indexed per image: one gather instead of a Python loop over the batch.
    windows = np.lib.stride_tricks.sliding_window_view(padded, (H, W), axis=(1, 2))  # B, 2p+1, 2p+1, C, H, W
    dy, dx = rng.integers(0, 2 * pad + 1, size=(2, B))
    return np.ascontiguousarray(windows[np.arange(B), dy, dx].transpose(0, 2, 3, 1))


def random_flip(x_BHWC: np.ndarray, rng: np.random.Generator, prob: float = 0.5) -> np.ndarray:
    """Mirrors each image left-right with probability `prob`."""
    flip = rng.random(len(x_BHWC)) < prob
    return np.where(flip[:, None, None, None], x_BHWC[:, :, ::-1], x_BHWC)


def text_windows(
    corpus: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """`batch` random windows of `seq_len + 1` bytes: inputs `x` (B, T) and next-byte targets `y` (B, T), int32."""
    if len(corpus) <= seq_len + 1:
        raise ValueError(f"text_windows: corpus of {len(corpus)} bytes is too short for seq_len {seq_len}")
    starts = rng.integers(0, len(corpus) - seq_len - 1, size=batch)
    windows = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def text_batch(
    corpus: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int, targets: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """`text_windows` as a batch dict; with `targets` (one weight per token of `corpus`: whether predicting that
    token counts, e.g. 0 for a prompt, 1 for its completion) also `loss_mask` (B, T) float32, the weights of
    `y`. A weighted corpus shorter than a window is padded with tokens that never count."""
    if targets is None:
        x, y = text_windows(corpus, rng, batch, seq_len)
        return {"x": x, "y": y}
    short = seq_len + 2 - len(corpus)
    if short > 0:
        corpus, targets = np.pad(corpus, (0, short)), np.pad(targets, (0, short))
    starts = rng.integers(0, len(corpus) - seq_len - 1, size=batch)
    index = starts[:, None] + np.arange(seq_len + 1)
    windows = corpus[index].astype(np.int32)
    return {"x": windows[:, :-1], "y": windows[:, 1:], "loss_mask": targets[index[:, 1:]].astype(np.float32)}
