"""What `jaxnn.fit` accepts as data, turned into one interface: training batch `i` and the iterator's state.

- numpy (or jax) arrays: `(x, y)` or a dict of arrays sharing their first axis -> `ArrayBatches`: each epoch a
  seeded permutation, batch `i` a pure function of (seed, i), so a resumed run sees exactly the same batches;
- a jaxnn data set (`ImageDataset`, `TextCorpus`) -> `TrainBatches` (normalisation, augmentation, text windows);
- any other iterable of batch dicts -> `IterableBatches`: used in order; a re-iterable one (a list, an object
  with `__iter__`) is iterated again when a pass ends, a one-shot iterator (a generator) ends the run when it
  runs out. Ready batches are never reordered (their order is the caller's, as with Keras generators and
  PyTorch iterable data sets); a resumed run skips the batches already consumed, which reproduces the run only
  if iterating again yields the same sequence.
`steps_per_epoch()` is the number of batches in one pass, or None where the data do not say (a generator).
Evaluation data takes the same forms, as padded batches whose `mask` marks the real rows.

Float inputs holding NaN or Inf are refused (`check_finite`) with one line naming the array and its first bad
index: in-memory arrays (an image data set's too) and evaluation batches at setup, before anything runs
(`check="arrays"`, the default); with `check="all"` also every training batch of a stream or data set, as it is
drawn.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxnn.data.datasets import DataError, ImageDataset, TextCorpus
from jaxnn.data.pipeline import (
    NumberedBatches,
    PipelineConfig,
    TrainBatches,
    epoch_permutation,
    eval_batches,
    host_iterator,
    iterator_state,
)


def as_arrays(data: object, role: str = "data") -> dict[str, np.ndarray] | None:
    """`(x, y)` or a dict of arrays as a dict of numpy arrays checked to share their first axis; None otherwise."""
    if isinstance(data, tuple) and len(data) == 2 and all(hasattr(a, "shape") for a in data):
        data = {"x": data[0], "y": data[1]}
    if not (isinstance(data, dict) and data and all(hasattr(a, "shape") for a in data.values())):
        return None
    arrays = {k: np.asarray(v) for k, v in data.items()}
    sizes = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise DataError(f"{role}: arrays must share their first (example) axis, got sizes {sizes}")
    if not next(iter(sizes.values())):
        raise DataError(f"{role}: the arrays hold no examples")
    return arrays


# Elements per np.isfinite call: bounds the temporary boolean array for inputs of many gigabytes.
_FINITE_CHUNK = 1 << 22


def check_finite(arrays: Mapping[str, Any], role: str) -> None:
    """Refuses NaN/Inf in any float array of `arrays`: a DataError naming `role`, the array and the first bad index.

    One pass over the data on the host; integer, boolean and other arrays are not looked at.
    """
    for name, value in arrays.items():
        array = np.asarray(value)
        if not _is_float(array.dtype):
            continue
        index = _first_non_finite(array)
        if index is not None:
            raise DataError(
                f"{role}: array {name!r} holds {array[index]} at index {index}; inputs must be finite "
                "(check_data='off' skips this check)"
            )


def _is_float(dtype: np.dtype) -> bool:
    # bfloat16 and the float8 types (ml_dtypes) are not numpy `inexact` subtypes.
    return np.issubdtype(dtype, np.inexact) or dtype.name.startswith(("bfloat", "float"))


def _first_non_finite(array: np.ndarray) -> tuple[int, ...] | None:
    if array.ndim == 0:
        return None if np.isfinite(array) else ()
    rows = max(1, _FINITE_CHUNK // max(1, math.prod(array.shape[1:])))
    for lo in range(0, len(array), rows):
        finite = np.isfinite(array[lo : lo + rows])
        if not finite.all():
            first = np.unravel_index(int(np.argmin(finite)), finite.shape)
            return (lo + int(first[0]), *(int(i) for i in first[1:]))
    return None


def _checked(batches: Iterator[dict[str, Any]], start: int) -> Iterator[dict[str, Any]]:
    for i, batch in enumerate(batches, start):
        if isinstance(batch, Mapping):  # anything else is refused by the loop, naming its type
            check_finite(batch, f"data: training batch {i}")
        yield batch


class ArrayBatches(NumberedBatches):
    """Training batches `start .. stop-1` drawn from in-memory arrays (random access, Grain's source protocol).

    Each epoch is a permutation seeded by `(seed, epoch)`; an epoch's last partial batch is dropped.
    """

    def __init__(
        self, arrays: dict[str, np.ndarray], batch_size: int, seed: int = 0, start: int = 0, stop: int = 1 << 40
    ) -> None:
        self.arrays, self.batch_size, self.seed, self.start, self.stop = arrays, batch_size, seed, start, stop
        self.num_examples = len(next(iter(arrays.values())))
        if batch_size > self.num_examples:
            raise DataError(f"batch size {batch_size} is larger than the {self.num_examples} training examples")
        self.steps_per_epoch = self.num_examples // batch_size
        self._init_permutations()

    def __repr__(self) -> str:
        return f"ArrayBatches({self.num_examples} examples, batch {self.batch_size}, start={self.start})"

    def _permutation_uncached(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.seed, epoch, self.num_examples)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(step, self.steps_per_epoch)
        idx = np.sort(self.permutation(epoch)[j * self.batch_size : (j + 1) * self.batch_size])
        return {k: v[idx] for k, v in self.arrays.items()}

    def state(self, next_step: int) -> dict[str, Any]:
        return {
            "next_step": int(next_step),
            "kind": "arrays",
            "num_train": self.num_examples,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }


class IterableBatches:
    """Batches from any iterable, in order, pass after pass; the state is the number of batches consumed.

    A one-shot iterator (`iter(it) is it`) gives one pass: its first batch, read for the shapes, is kept and
    trained on first, and the iterator running out ends the run.
    """

    def __init__(self, iterable: Iterable[dict[str, Any]], check_each: bool = False) -> None:
        self.iterable, self.check_each = iterable, check_each
        self.one_shot = iter(iterable) is iterable
        self._first: dict[str, Any] | None = None

    def example(self) -> dict[str, Any]:
        if self._first is None:
            try:
                self._first = next(iter(self.iterable))
            except StopIteration:
                raise DataError("data: the iterable yields no batches") from None
        return self._first

    def steps_per_epoch(self) -> int | None:
        return len(self.iterable) if hasattr(self.iterable, "__len__") else None  # type: ignore[arg-type]

    def iterator(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        if self.one_shot:
            batches = itertools.islice(itertools.chain([self.example()], self.iterable), start, stop)
        else:
            batches = itertools.islice(self._passes(), start, stop)
        return _checked(batches, start) if self.check_each else batches

    def _passes(self) -> Iterator[dict[str, Any]]:
        while True:
            n = 0
            for batch in self.iterable:
                n += 1
                yield batch
            if n == 0:  # a pass that yields nothing would loop for ever
                return

    def state(self, next_step: int) -> dict[str, Any]:
        return {"next_step": int(next_step), "kind": "iterable"}


class DatasetBatches:
    """A jaxnn data set through the host pipeline (`TrainBatches`, Grain workers or inline)."""

    def __init__(self, data: ImageDataset | TextCorpus, pipeline: PipelineConfig, check_each: bool = False) -> None:
        self.data, self.pipeline, self.check_each = data, pipeline, check_each
        self._source = TrainBatches(data, pipeline)
        if isinstance(data, ImageDataset) and pipeline.batch_size > len(data.x_train):
            raise DataError(
                f"batch size {pipeline.batch_size} is larger than the {len(data.x_train)} training "
                f"examples of {data.name}"
            )

    def example(self) -> dict[str, np.ndarray]:
        return self._source.batch(0)

    def steps_per_epoch(self) -> int:
        return int(self._source.steps_per_epoch)

    def iterator(self, start: int, stop: int) -> Iterator[dict[str, np.ndarray]]:
        batches = host_iterator(TrainBatches(self.data, self.pipeline, start, stop), self.pipeline)
        return _checked(batches, start) if self.check_each else batches

    def state(self, next_step: int) -> dict[str, Any]:
        return iterator_state(next_step, self._source)


class ArraySource:
    """`ArrayBatches` behind the same interface as the other sources."""

    def __init__(self, arrays: dict[str, np.ndarray], pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self._batches = ArrayBatches(arrays, pipeline.batch_size, pipeline.seed)

    def example(self) -> dict[str, np.ndarray]:
        return self._batches.batch(0)

    def steps_per_epoch(self) -> int:
        return int(self._batches.steps_per_epoch)

    def iterator(self, start: int, stop: int) -> Iterator[dict[str, np.ndarray]]:
        b = self._batches
        return host_iterator(ArrayBatches(b.arrays, b.batch_size, b.seed, start, stop), self.pipeline)

    def state(self, next_step: int) -> dict[str, Any]:
        return self._batches.state(next_step)


def _default_pipeline(pipeline: PipelineConfig | None, batch_size: int | None, seed: int) -> PipelineConfig:
    if pipeline is not None:
        return pipeline
    if batch_size is None:
        raise DataError("data: arrays and data sets need a batch_size")
    return PipelineConfig(batch_size=batch_size, seed=seed, backend="inline")


def as_train_source(
    data: object, pipeline: PipelineConfig | None, batch_size: int | None, seed: int, *, check: str = "arrays"
) -> DatasetBatches | ArraySource | IterableBatches:
    """The source for `data` (see the module docstring); bad data raises DataError before anything runs.

    `check`: "arrays" refuses non-finite in-memory arrays here, "all" also each drawn batch of a stream or data
    set, "off" neither (FitConfig.check_data).
    """
    if isinstance(data, (ImageDataset, TextCorpus)):
        if check != "off" and isinstance(data, ImageDataset):
            check_finite({"x_train": data.x_train}, f"data ({data.name})")
        return DatasetBatches(data, _default_pipeline(pipeline, batch_size, seed), check_each=check == "all")
    arrays = as_arrays(data, "data")
    if arrays is not None:
        if check != "off":
            check_finite(arrays, "data")
        return ArraySource(arrays, _default_pipeline(pipeline, batch_size, seed))
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise DataError(
            f"data: expected (x, y) arrays, a dict of arrays, a jaxnn data set or an iterable of batch "
            f"dicts, got {type(data).__name__}"
        )
    return IterableBatches(data, check_each=check == "all")


def as_eval_batches(
    data: object, batch_size: int, *, seq_len: int = 128, seed: int = 0, check: str = "arrays"
) -> list[dict[str, Any]] | None:
    """Evaluation batches of `batch_size` rows: arrays padded with `mask` 0, data sets' test splits, or as given.

    Unless `check` is "off", a NaN/Inf in them is refused here: it would otherwise come back as a `nan` metric.
    """
    if data is None:
        return None
    if isinstance(data, (ImageDataset, TextCorpus)):
        if check != "off" and isinstance(data, ImageDataset):
            check_finite({"x_test": data.x_test}, f"eval_data ({data.name})")
        return eval_batches(data, batch_size, seq_len=seq_len, seed=seed)
    arrays = as_arrays(data, "eval_data")
    if arrays is None:
        if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
            raise DataError(
                f"eval_data: expected arrays, a data set or an iterable of batches, got {type(data).__name__}"
            )
        return _checked_batches(list(data), check)
    if check != "off":
        check_finite(arrays, "eval_data")  # before padding, so that the index is the array's own
    return _padded_batches(arrays, batch_size)


def _checked_batches(batches: list[Any], check: str) -> list[Any]:
    if check != "off":
        for i, batch in enumerate(batches):
            if isinstance(batch, Mapping):
                check_finite(batch, f"eval_data: batch {i}")
    return batches


def _padded_batches(arrays: dict[str, np.ndarray], batch_size: int) -> list[dict[str, Any]]:
    n = len(next(iter(arrays.values())))
    batches = []
    for lo in range(0, n, batch_size):
        idx = np.arange(lo, lo + batch_size)
        real = idx < n
        batch: dict[str, Any] = {k: v[np.where(real, idx, 0)] for k, v in arrays.items()}
        batch["mask"] = real.astype(np.float32)
        batches.append(batch)
    return batches
