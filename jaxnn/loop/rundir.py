"""Run directories: one writer at a time, and the files of one run (config, metrics, plots, summary).

- `RunLock` (`jaxnn._src.run_lock`, importable from here): the lock file held for a run's life.
- `RunFiles`: checks, locks and writes one run directory (process 0), through `jaxnn._src.storage`'s whole-file writes;
  it records the run's id in the run and checkpoint directories (`jaxnn._src.ownership`) and never writes into, rotates
  or removes checkpoints of another run.
- the run's records: `json_record` (config.json as it reads back), `model_record` (parameter count and shapes' digest)
  and `input_record` (the summary's input: shape, dtype, normalisation).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnn._src.checks import config_differences
from jaxnn._src.optimizer_id import FIELD
from jaxnn._src.optional import available
from jaxnn._src.ownership import (
    OWNER_FILE,
    check_checkpoint_dir,
    checkpoint_entries,
    new_run_id,
    read_owner,
    write_owner,
)
from jaxnn._src.run_lock import LOCK_NAME, RunLock
from jaxnn._src.storage import (
    RunDirError,
    StorageError,
    check_writable,
    make_dirs,
    write_json_atomic,
)
from jaxnn.errors import ConfigError
from jaxnn.loop.plots import write_plots
from jaxnn.metric_services import SERVICE_FILES
from jaxnn.metrics import make_writers

if TYPE_CHECKING:
    from jaxnn.config import FitConfig
    from jaxnn.metrics import MetricWriter

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------- a run's files

RUN_FILES = (
    "config.json", "summary.json", "metrics.jsonl", "loss.png", "accuracy.png", "tensorboard", "tokenizer", OWNER_FILE,
    *SERVICE_FILES,
)  # fmt: skip


class RunFiles:
    """The files of one run directory: checked and locked by `open`, written by process 0, released by `close`.

    Without a run directory (`cfg.run_dir` None) every method does nothing, and nothing is checkpointed.
    """

    def __init__(self, cfg: FitConfig, record: dict, *, is_main: bool = True):
        self.cfg, self.record, self.is_main = cfg, record, is_main
        self.run_dir = pathlib.Path(cfg.run_dir) if cfg.run_dir else None
        self.ckpt_dir = (
            (pathlib.Path(cfg.ckpt_dir) if cfg.ckpt_dir else self.run_dir / "ckpt") if self.run_dir else None
        )
        self._lock = RunLock(self.run_dir) if self.run_dir else None
        self._writers: list[MetricWriter] = []
        self._created = False
        self.run_id: str | None = None  # set by `open`: this run's id, recorded in its directories

    @property
    def _root(self) -> pathlib.Path:
        assert self.run_dir is not None, "only called with a run directory"
        return self.run_dir

    @property
    def _ckpt(self) -> pathlib.Path:
        assert self.ckpt_dir is not None, "only called with a run directory"
        return self.ckpt_dir

    @property
    def _held(self) -> RunLock:
        assert self._lock is not None, "only called with a run directory"
        return self._lock

    def open(self) -> None:
        """Checks, creates and locks the run directory and writes config.json (process 0); no-op without one."""
        if self.run_dir is None:
            return
        error = None
        if self.is_main:
            try:
                self._open_main()
            except (RunDirError, StorageError, ValueError) as err:
                error = err
        if not _all_processes_agree(error is None):
            raise error or RunDirError(f"process 0 refused the run directory {self.run_dir} (see its output)")

    def _open_main(self) -> None:
        self._check_free()
        check_writable(self._root)
        check_writable(self._ckpt)
        self._created = not self._root.exists()
        self._root.mkdir(parents=True, exist_ok=True)
        try:
            self._held.acquire()
        except RunDirError:
            self._remove_if_created()
            raise
        try:
            self._check_use()
            self._check_checkpoints()
            kept = self._continued_id() if self.cfg.resume else None
            if self.cfg.overwrite:
                self._clear()
            self.run_id = kept or new_run_id()
            self._claim()
            self._write_config()
            self._writers = make_writers(self.cfg.metrics, self._root, run_id=self.run_id, config=self.record)
        except BaseException:
            self._held.release()
            self._remove_if_created()
            raise

    def _remove_if_created(self) -> None:
        if self._created and self._root.is_dir() and not any(self._root.iterdir()):
            self._root.rmdir()

    def _saved_config(self) -> dict | None:
        path = self._root / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    def precheck(self) -> None:
        """The checks `open` makes, read-only and on the record known so far, so that a run directory in use is
        refused before the model is compiled; `open` repeats them under the lock with the whole record."""
        if self.run_dir is None or not self.is_main:
            return
        self._check_free()
        check_writable(self.run_dir)
        check_writable(self._ckpt)
        if self.run_dir.is_dir():
            self._check_use(partial=True)
        self._check_checkpoints()

    def _check_free(self) -> None:
        """A directory another live process holds is refused first, naming the holder, whatever else is there."""
        if self._root.is_dir():
            self._held.check_free()

    def _continued_id(self) -> str | None:
        """The id of the run this one continues (resume) or replaces (overwrite): the run directory's owner."""
        owner = read_owner(self._root) if self._root.is_dir() else None
        return owner.get("run_id") if owner else None

    def _is_legacy(self) -> bool:
        """A run directory written before owner files: its unowned checkpoints are its own."""
        return read_owner(self._root) is None and (self._root / "config.json").is_file()

    def _check_checkpoints(self) -> None:
        """Refuses a checkpoint directory holding another run's checkpoints or foreign files, before any write."""
        continues = self.cfg.resume or self.cfg.overwrite
        check_checkpoint_dir(
            self._ckpt,
            self._continued_id() if continues else None,
            legacy_ok=continues and self._is_legacy(),
        )

    def _claim(self) -> None:
        """Records this run as the owner of its run and checkpoint directories."""
        assert self.run_id is not None
        make_dirs(self._ckpt)
        for directory in (self._root, self._ckpt):
            if (read_owner(directory) or {}).get("run_id") != self.run_id:  # a resume leaves its record as it was
                write_owner(directory, self.run_id, self._root)

    def _check_use(self, partial: bool = False) -> None:
        """Refuses a run directory holding another run, unless resume or overwrite says what to do with it."""
        used = [p for p in self._root.iterdir() if p.name != LOCK_NAME]
        if not used or self.cfg.overwrite:
            return
        saved = self._saved_config()
        if saved is not None and partial:
            saved = {k: v for k, v in saved.items() if k in self.record}
        # The optimizer's fingerprint has its own check (jaxnn.loop._resume_checks), with its override.
        diffs = config_differences(saved, self.record, (FIELD,), saved_as="saved") if saved is not None else []
        if diffs:
            raise RunDirError(
                f"run dir {self._root} belongs to a different config ({'; '.join(diffs)}); "
                "resume it with the same settings, overwrite it, or choose another run dir"
            )
        if not self.cfg.resume and saved is None and (self._root / "config.json").is_file():
            raise RunDirError(
                f"run dir {self._root} holds a damaged config.json (not JSON: cut short or edited?); pass --resume "
                "(resume=True) to set it aside and continue the run, --overwrite (overwrite=True) to replace the "
                "run, or another run dir"
            )
        if not self.cfg.resume:
            raise RunDirError(
                f"run dir {self._root} already holds a run; pass --resume (resume=True) to continue "
                "it, --overwrite (overwrite=True) to replace it, or another run dir"
            )

    def _clear(self) -> None:
        """Removes what the replaced run wrote (its files and checkpoints, checked to be its own) and says so."""
        targets = [self._root / name for name in RUN_FILES]
        targets += list(self._root.glob("metrics-*.csv")) + list(self._root.glob("*.partial-*"))
        checkpoints, _ = checkpoint_entries(self._ckpt)
        targets += [*checkpoints, self._ckpt / OWNER_FILE]
        removed = []
        for path in targets:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            else:
                continue
            removed.append(str(path.relative_to(self._root)) if path.is_relative_to(self._root) else str(path))
        if self._ckpt.is_dir() and not any(self._ckpt.iterdir()):
            self._ckpt.rmdir()
        if removed:
            log.warning("overwrite: removed the previous run's files from %s: %s", self._root, ", ".join(removed))

    def _write_config(self) -> None:
        path = self._root / "config.json"
        if path.is_file() and self._saved_config() is None:
            aside = path.with_name(f"config.json.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            log.warning("%s was damaged (not JSON); set aside as %s and written again", path, aside.name)
        write_json_atomic(path, self.record)

    def write(self, row: dict) -> None:
        for writer in self._writers:
            writer.write(row)

    def resumed_from(self, step: int) -> None:
        log.info("resuming %s from step %d", self.run_dir, step)

    def previous_summary(self) -> dict:
        path = self.run_dir / "summary.json" if self.run_dir else None
        try:
            return json.loads(path.read_text()) if path and path.is_file() else {}
        except ValueError:
            return {}

    def finish(self, summary: dict, *, plots: bool) -> None:
        """summary.json (atomically) and the plots; process 0 only."""
        if not (self.run_dir and self.is_main):
            return
        write_json_atomic(self.run_dir / "summary.json", summary)
        metrics = self.run_dir / "metrics.jsonl"
        if plots and metrics.is_file() and available("matplotlib", "the loss and accuracy plots"):
            summary["plots"] = write_plots(metrics, self.run_dir)
            write_json_atomic(self.run_dir / "summary.json", summary)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []
        if self._lock:
            self._lock.release()


# ----------------------------------------------------------------------------------------------- the run's records


def json_record(record: dict) -> dict:
    """`record` as it reads back from JSON (tuples become lists), so a saved copy compares equal to it."""
    try:
        return json.loads(json.dumps(record))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fit: config must hold JSON values (numbers, strings, lists, dicts): {err}") from None


def model_record(params: Any) -> dict:
    """The parameter count and a digest of the parameter shapes: a resume into another model is refused early."""
    import jax

    shapes = jax.tree_util.tree_flatten_with_path(params)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in shapes)
    return {
        "num_params": int(sum(np.prod(x.shape) for _, x in shapes)),
        "param_shapes": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def input_record(source: Any) -> dict | None:
    """One example's input as the summary records it (what `jaxnn.save_model` keeps for exports and `jaxnn
    predict`): shape without the batch axis and dtype, and for a jaxnn image data set the normalisation its
    pipeline applied to the stored images; None for an input that is not one array (a tuple of them)."""
    from jaxnn.data.datasets import ImageDataset

    x = source.example()["x"]
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return None
    record: dict[str, Any] = {"shape": [int(d) for d in x.shape[1:]], "dtype": np.dtype(x.dtype).name}
    data = getattr(source, "data", None)
    if isinstance(data, ImageDataset):
        record["normalise"] = {
            "stored_dtype": np.dtype(data.x_train.dtype).name,
            "scale": float(data.scale),
            "mean": [float(m) for m in np.ravel(data.mean)],
            "std": [float(v) for v in np.ravel(data.std)],
        }
    return record


def _all_processes_agree(ok: bool) -> bool:
    """Whether process 0 says `ok` (every process must call this); trivially `ok` in a single process."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def fresh_run_dir(root: str | os.PathLike[str] = "runs") -> str:
    """A new, not yet existing run directory `<root>/<YYYYmmdd-HHMMSS>` (with `-2`, `-3`, ... when taken).

    For a script run again and again: `fit(..., run_dir=jaxnn.fresh_run_dir("runs/mine"))` writes each run
    beside the last instead of being refused by the run directory the previous one left (`resume=True` with a
    fixed run_dir continues one run instead).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(root) / stamp
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{stamp}-{n}")
    return str(candidate)
