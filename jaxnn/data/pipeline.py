"""The host pipeline: batch `i` of a run is a pure function of (data, config, i); background workers compute them.

Because a batch depends only on its index (the epoch's permutation is seeded by `(seed, epoch)`, augmentation by
`(seed, step)`), the iterator's whole state is the index of the next batch: a resumed run rebuilds the loader at
that index and sees exactly the batches an uninterrupted run would have seen, whatever the workers had
prefetched. Workers are Grain's `DataLoader` (reader threads in this process, or worker processes); `"inline"`
computes each batch in the caller's thread (no overlap, and no Grain needed).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from jaxnn._src.checks import check_seed
from jaxnn.data.datasets import ImageDataset, TextCorpus
from jaxnn.data.preprocess import normalise, random_crop, random_flip, text_batch

log = logging.getLogger(__name__)

BACKENDS = ("grain", "inline")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How batches are drawn, augmented and computed.

    ragged: what happens to an epoch's last partial batch in training, "drop" it or "pad" it (padding rows repeat
      real examples and carry mask 0). Evaluation always pads, so every test example counts exactly once.
    backend: "grain" (Grain DataLoader) or "inline" (the caller's thread).
    workers: Grain worker processes; 0 keeps Grain in this process with `threads` reader threads, which measured
      faster on this 2-core machine (docs/data.md).
    augment_repeats: how many times crop and flip are applied, a knob for the input benchmark only.
    """

    batch_size: int = 64
    seed: int = 0
    ragged: str = "drop"
    crop_pad: int = 0
    flip: bool = False
    seq_len: int = 128
    backend: str = "grain"
    workers: int = 0
    threads: int = 1
    buffer: int = 4
    augment_repeats: int = 1

    def __post_init__(self) -> None:
        check_seed("PipelineConfig", self.seed)
        if self.batch_size <= 0:
            raise ValueError(f"PipelineConfig: batch_size must be positive, got {self.batch_size}")
        if self.ragged not in ("drop", "pad"):
            raise ValueError(f"PipelineConfig: ragged must be 'drop' or 'pad', got {self.ragged!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"PipelineConfig: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.workers < 0 or self.threads < 0 or self.buffer < 1:
            raise ValueError("PipelineConfig: workers and threads must be >= 0 and buffer >= 1")

    def small(self) -> PipelineConfig:
        """The same pipeline with 16-example batches and 32-token windows, for tests and smoke runs."""
        return dataclasses.replace(self, batch_size=16, seq_len=32)


class BatchSource(Protocol):
    """Grain's random-access source protocol, as `host_iterator` uses it: a length and batch number -> batch."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...


def steps_per_epoch(num_examples: int, batch_size: int, ragged: str = "drop") -> int:
    """Batches in one pass over `num_examples`: a partial last batch is dropped ("drop") or padded ("pad")."""
    if ragged == "drop":
        return max(num_examples // batch_size, 1)
    return -(-num_examples // batch_size)


class CachedPermutations:
    """Mixin for random-access batch sources: `permutation(epoch)`, each epoch's seeded example order computed once
    per instance (not once per batch), and left out of pickles: Grain's worker processes receive the source
    pickled, and the cache, which wraps a bound method, cannot be. Subclasses define `_permutation_uncached`."""

    def _init_permutations(self) -> None:
        # Per instance: a cache on the method itself would keep every instance alive.
        self._permutation: Callable[[int], np.ndarray] = functools.lru_cache(maxsize=2)(self._permutation_uncached)

    def _permutation_uncached(self, epoch: int) -> np.ndarray:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_permutation"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_permutations()

    def permutation(self, epoch: int) -> np.ndarray:
        return self._permutation(epoch)


class NumberedBatches(CachedPermutations):
    """Mixin for Grain's random-access source protocol over batches `start .. stop-1`: `len()` and `[i]` (the
    batch `start + i`). Subclasses set `start` and `stop` and define `batch(step)`."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.batch(self.start + int(i))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch of training step `step`."""
        raise NotImplementedError


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The order of the examples in `epoch`: a permutation seeded by `(seed, epoch)`."""
    return np.random.default_rng([seed, 0, epoch]).permutation(num_examples)


class TrainBatches(NumberedBatches):
    """Training batch number -> batch dict, for batches `start .. stop-1`; Grain's random-access source protocol.

    Image batches: `x` float32 (B, H, W, C) normalised and augmented, `y` int32 (B,), `mask` float32 (B,).
    Text batches: `x`, `y` int32 (B, T), random windows of the training tokens, and `loss_mask` (B, T) where the
    corpus weighs its tokens (prompt/completion records).
    """

    def __init__(
        self, data: ImageDataset | TextCorpus, cfg: PipelineConfig, start: int = 0, stop: int = 1 << 40
    ) -> None:
        self.data, self.cfg, self.start, self.stop = data, cfg, start, stop
        self.is_text = isinstance(data, TextCorpus)
        self._init_permutations()
        if isinstance(data, TextCorpus):
            self.steps_per_epoch = max(len(data.train) // (cfg.batch_size * cfg.seq_len), 1)
        else:
            self.steps_per_epoch = steps_per_epoch(len(data.x_train), cfg.batch_size, cfg.ragged)

    def __repr__(self) -> str:  # Grain logs its source; keep the arrays out of it
        return f"TrainBatches({self.data.name}, start={self.start}, stop={self.stop}, {self.cfg})"

    def _permutation_uncached(self, epoch: int) -> np.ndarray:
        if isinstance(self.data, TextCorpus):
            raise TypeError(f"TrainBatches: text corpus {self.data.name!r} has no example order to permute")
        return epoch_permutation(self.cfg.seed, epoch, len(self.data.x_train))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """Batch number `step` of the run (not of this slice), the same on every call and every machine."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 1, step])
        d = self.data
        if isinstance(d, TextCorpus):
            return text_batch(d.train, rng, cfg.batch_size, cfg.seq_len, d.train_targets)
        epoch, j = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)
        idx = perm[j * cfg.batch_size : (j + 1) * cfg.batch_size]
        mask = np.ones(cfg.batch_size, np.float32)
        if len(idx) < cfg.batch_size:
            mask[len(idx) :] = 0.0
            idx = np.concatenate([idx, perm[: cfg.batch_size - len(idx)]])
        x = normalise(d.x_train[idx], d.scale, d.mean, d.std)
        for _ in range(cfg.augment_repeats if (cfg.crop_pad or cfg.flip) else 0):
            x = random_crop(x, rng, cfg.crop_pad)
            x = random_flip(x, rng) if cfg.flip else x
        return {"x": x, "y": d.y_train[idx], "mask": mask}


def eval_batches(
    data: ImageDataset | TextCorpus, batch_size: int, *, seq_len: int = 128, seed: int = 0, max_text_batches: int = 4
) -> list[dict[str, np.ndarray]]:
    """The test split as padded batches with a `mask` (images), or a fixed seeded set of windows (text)."""
    if isinstance(data, TextCorpus):
        rng = np.random.default_rng([seed, 2])
        n = min(max_text_batches, max(len(data.test) // (batch_size * seq_len), 1))
        return [text_batch(data.test, rng, batch_size, seq_len, data.test_targets) for _ in range(n)]
    x = normalise(data.x_test, data.scale, data.mean, data.std)
    batches = []
    for lo in range(0, len(x), batch_size):
        idx = np.arange(lo, lo + batch_size)
        mask = (idx < len(x)).astype(np.float32)
        idx = np.where(idx < len(x), idx, 0)
        batches.append({"x": x[idx], "y": data.y_test[idx], "mask": mask})
    return batches


def host_iterator(source: BatchSource, cfg: PipelineConfig) -> Iterator[dict[str, np.ndarray]]:
    """Iterates the batches of `source` in order, computed by Grain's workers or inline."""
    from jaxnn._src.optional import available

    backend = cfg.backend
    if backend == "grain" and not available("grain", "Grain's worker processes"):
        backend = "inline"  # the same batches, computed in this process
    if backend == "inline":
        return (source[i] for i in range(len(source)))
    import grain.python as grain

    if cfg.workers > 0:
        # Grain's worker processes read absl flags, which nothing parses in a plain script.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.SequentialSampler(len(source), grain.NoSharding()),
        worker_count=cfg.workers,
        worker_buffer_size=cfg.buffer,
        read_options=grain.ReadOptions(num_threads=cfg.threads, prefetch_buffer_size=cfg.buffer),
    )
    return iter(loader)


def iterator_state(next_step: int, source: TrainBatches) -> dict[str, Any]:
    """The JSON-able data-iterator state saved with a checkpoint: where to restart, and what it is valid for."""
    d = source.data
    size = len(d.train) if isinstance(d, TextCorpus) else len(d.x_train)
    return {
        "next_step": int(next_step),
        "dataset": d.name,
        "num_train": int(size),
        "batch_size": source.cfg.batch_size,
        "seed": source.cfg.seed,
        "ragged": source.cfg.ragged,
    }
