"""Optimizers: `make_optimizer` (AdamW, clipping, decay on kernels only) on `make_schedule` (warm-up, then one of
`SCHEDULES`), and `check_optimizer`, which refuses anything but an optax transformation."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxnn.layers.core import Params


def weight_decay_mask(params: Params) -> Any:
    """True for kernels (leaves named "w"), False for biases, norm scales and embedding tables."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "w", params)


# The decays `make_schedule` offers after the warm-up; `jaxnn train --schedule` is checked against them.
SCHEDULES = ("cosine", "constant")


def make_schedule(
    learning_rate: float = 1e-3, *, total_steps: int = 1000, warmup_steps: int = 0, decay: str = "cosine"
) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `warmup_steps`, then cosine decay to 0 at `total_steps`
    (`decay="cosine"`) or `learning_rate` from then on (`decay="constant"`: a run can be trained on past
    `total_steps` along the same schedule)."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate!r}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps!r}")
    if decay not in SCHEDULES:
        raise ValueError(f"unknown schedule {decay!r}; choose one of {list(SCHEDULES)}")
    if decay == "constant":
        return optax.warmup_constant_schedule(0.0 if warmup_steps else learning_rate, learning_rate, warmup_steps)
    return optax.warmup_cosine_decay_schedule(
        0.0 if warmup_steps else learning_rate, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1)
    )


def make_optimizer(
    learning_rate: float = 1e-3,
    *,
    total_steps: int = 1000,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    decay: str = "cosine",
) -> optax.GradientTransformation:
    """AdamW on `make_schedule`, global-norm clipping, and decay on kernels only (all optax)."""
    schedule = make_schedule(learning_rate, total_steps=total_steps, warmup_steps=warmup_steps, decay=decay)
    adamw = optax.adamw(schedule, weight_decay=weight_decay, mask=weight_decay_mask)
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw


def check_optimizer(tx: Any, argument: str = "optimizer") -> None:
    """Refuses anything but an optax GradientTransformation (a None optimizer would fail deep inside the step);
    `argument` names it as the caller's signature does."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{argument} must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got {type(tx).__name__}"
        )
