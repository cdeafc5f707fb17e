"""The checks every configuration shares: positive integers, seeds, differences between two records worded one way.
Each raises `ConfigError` in one line naming its owner and field. Internal: `jaxnn.config` re-exports what users
of the API met there (`config_differences`, `first_differences`, `check_seed`)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from jaxnn.errors import ConfigError

# numpy's and jax's seeding take 32-bit unsigned seeds; a larger or negative one fails deep inside them.
SEED_LIMIT = 2**32


def config_differences(
    saved: dict, current: dict, ignore: Iterable[str] = (), *, saved_as: str = "checkpoint", now_as: str = "now"
) -> list[str]:
    """Human-readable `field: checkpoint X, now Y` lines for the keys where two dicts differ (`-`: absent); the
    one way jaxnn words a difference, of configs as of parameter shapes."""
    keys = sorted((set(saved) | set(current)) - set(ignore))
    missing = object()
    return [
        f"{k}: {saved_as} {saved.get(k, missing)!r}, {now_as} {current.get(k, missing)!r}".replace(repr(missing), "-")
        for k in keys
        if saved.get(k, missing) != current.get(k, missing)
    ]


def first_differences(diffs: list[str], limit: int = 4) -> str:
    """`diffs` joined for one line: the first `limit`, then "..." when there are more."""
    return "; ".join(diffs[:limit]) + ("; ..." if len(diffs) > limit else "")


def check_seed(owner: str, value: Any, argument: str = "seed") -> None:
    """Refuses a seed that is not an integer in [0, 2**32), naming the owner, the argument it came as and the value."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= int(value) < SEED_LIMIT:
        raise ConfigError(f"{owner}: {argument} must be an integer in [0, 2**32), got {value!r}")


def check_compile_cache(owner: str, value: Any) -> None:
    """Refuses a compile-cache setting that is not a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}: compile_cache must be 'auto', 'off' or a directory, got {value!r}")


def positive_int(owner: str, name: str, value: Any) -> None:
    """Refuses anything but a positive int (a bool included), naming the owner and the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")


def non_negative(owner: str, name: str, value: Any) -> None:
    """Refuses anything but a number >= 0 (NaN and bools included), naming the owner and the field."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ConfigError(f"{owner}: {name} must be >= 0, got {value!r}")
