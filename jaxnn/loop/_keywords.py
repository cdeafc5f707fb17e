"""fit's Keras-style data keywords, applied to the arrays before the run is set up: `validation_split` (the last
fraction of the examples, before any shuffling, becomes the evaluation data) and `class_weight` / `sample_weight`
(one weight per training example, as `batch["mask"]`, which the classification losses read as a weighted mean).
Internal to `jaxnn.loop`; each bad value is one ConfigError naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxnn.config import ConfigError
from jaxnn.data.sources import as_arrays


def keras_data(data: Any, eval_data: Any, split: Any, class_weight: Any, sample_weight: Any) -> tuple:
    """(training data, evaluation data, the facts for the run's record) after `weighted` and `split_validation`;
    the held-out examples are evaluated unweighted."""
    data = weighted(data, class_weight, sample_weight)
    data, eval_data = split_validation(data, eval_data, split)
    if split is not None and (class_weight is not None or sample_weight is not None):
        eval_data = {k: v for k, v in eval_data.items() if k != "mask"}
    facts: dict[str, Any] = {} if split is None else {"validation_split": split}
    if class_weight is not None:
        facts["class_weight"] = {str(k): float(v) for k, v in class_weight.items()}
    return data, eval_data, facts


def split_validation(data: Any, eval_data: Any, split: float | None) -> tuple[Any, Any]:
    """(training data, evaluation data): with `split`, the last `round(n * split)` examples of `data`'s arrays
    are held out for evaluation, as Keras does."""
    if split is None:
        return data, eval_data
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 < split < 1:
        raise ConfigError(f"fit: validation_split must be a fraction in (0, 1), got {split!r}")
    if eval_data is not None:
        raise ConfigError("fit: validation_split and eval_data exclude each other; give one")
    arrays = as_arrays(data)
    if arrays is None:
        raise ConfigError(
            f"fit: validation_split needs (x, y) or a dict of arrays, got {type(data).__name__}; pass eval_data"
        )
    n = len(next(iter(arrays.values())))
    held = round(n * split)
    if held < 1 or held >= n:
        raise ConfigError(
            f"fit: validation_split {split} of {n} examples leaves no "
            f"{'evaluation' if held < 1 else 'training'} example"
        )
    return {k: v[: n - held] for k, v in arrays.items()}, {k: v[n - held :] for k, v in arrays.items()}


def weighted(data: Any, class_weight: dict | None, sample_weight: Any) -> Any:
    """`data`'s arrays with one weight per example in "mask": `sample_weight` times `class_weight[y]`."""
    if class_weight is None and sample_weight is None:
        return data
    arrays = as_arrays(data)
    if arrays is None:
        raise ConfigError(
            f"fit: class_weight and sample_weight need (x, y) or a dict of arrays, got {type(data).__name__}"
        )
    if "mask" in arrays:
        raise ConfigError("fit: the data already hold 'mask'; give the weights there or as sample_weight, not both")
    n = len(arrays["x"])
    weights = np.ones(n, np.float32)
    if sample_weight is not None:
        given = np.asarray(sample_weight, np.float32)
        if given.shape != (n,) or not np.all(np.isfinite(given)) or given.min() < 0:
            raise ConfigError(
                f"fit: sample_weight must hold one finite weight >= 0 per example ({n}), got shape {given.shape}"
            )
        weights = weights * given
    if class_weight is not None:
        weights = weights * _per_class(class_weight, arrays)
    return {**arrays, "mask": weights}


def _per_class(class_weight: Any, arrays: dict) -> np.ndarray:
    if not isinstance(class_weight, dict) or "y" not in arrays:
        raise ConfigError(
            f"fit: class_weight must be a dict {{class: weight}} for data with labels 'y', got {class_weight!r}"
        )
    labels = np.asarray(arrays["y"])
    missing = sorted(set(np.unique(labels).tolist()) - set(class_weight))
    if missing:
        raise ConfigError(f"fit: class_weight has no weight for class(es) {missing[:5]} of the labels 'y'")
    bad = {k: v for k, v in class_weight.items() if not (isinstance(v, (int, float)) and v >= 0)}
    if bad:
        raise ConfigError(f"fit: class_weight's weights must be numbers >= 0, got {bad}")
    lookup = np.vectorize(lambda label: float(class_weight[label]), otypes=[np.float32])
    return lookup(labels)
