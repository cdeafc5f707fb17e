"""Metric writers for the training loop: JSON lines (always), CSV, TensorBoard event files, and the tracking
services Weights & Biases and MLflow (`jaxnn.metric_services`).

A row is a flat dict with `split` ("train" or "eval"), `step`, and scalar metrics. Every writer has `write(row)`
and `close()`; `make_writers(names, run_dir)` builds the ones a run asks for. TensorBoard files are written with
tensorboardX: it needs only protobuf and numpy, where the tensorboard package brings its web server and its
dependencies along; TensorBoard reads the files either way.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import pathlib
from collections.abc import Iterable
from typing import Protocol

from jaxnn._src.optional import hint, importable
from jaxnn._src.storage import PathLike, append_line, repair_jsonl, storage_error
from jaxnn.metric_services import make_service_writer

log = logging.getLogger(__name__)

WRITERS = ("jsonl", "csv", "tensorboard", "wandb", "mlflow")
# writer -> the library it needs (an optional dependency, in the extra of the same name)
LIBRARIES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


class MetricWriter(Protocol):
    """What `jaxnn.fit` writes metric rows to (`metrics=` names them: "jsonl", "csv", "tensorboard", "wandb",
    "mlflow")."""

    def write(self, row: dict) -> None:
        """Record one row: `split` ("train" or "eval"), `step`, and that step's scalar metrics."""

    def close(self) -> None:
        """Flush and release the files, once, when the run ends."""


def _json_safe(value):
    # JSON has no NaN/Inf; a diverged run's rows must still parse.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlWriter:
    """`metrics.jsonl`: one JSON object per line, appended whole; a line cut short by a crash is set aside."""

    def __init__(self, path: PathLike):
        self.path = pathlib.Path(path)
        repair_jsonl(self.path)

    def write(self, row: dict) -> None:
        """Append the row as one JSON line (NaN and Inf as strings, which JSON lacks)."""
        append_line(self.path, json.dumps({k: _json_safe(v) for k, v in row.items()}))

    def close(self) -> None:
        """Nothing to release: each row is appended and closed as it is written."""
        pass


def read_jsonl(path: PathLike) -> list[dict]:
    """The rows of a metrics file; lines that do not parse are skipped with a warning naming file and line."""
    path = pathlib.Path(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            log.warning("%s:%d is not a JSON line; skipped", path, number)
    return rows


class CsvWriter:
    """`metrics-<split>.csv`, one per split, one column per metric; a metric first seen late rewrites the file
    with the wider header (rows are few, and a spreadsheet wants one table per split)."""

    def __init__(self, run_dir: PathLike):
        self.run_dir = pathlib.Path(run_dir)
        self._columns: dict[str, list[str]] = {}

    def _path(self, split: str) -> pathlib.Path:
        return self.run_dir / f"metrics-{split}.csv"

    def _known_columns(self, split: str) -> list[str]:
        if split not in self._columns:
            path = self._path(split)
            header = path.read_text().splitlines()[:1] if path.is_file() else []
            self._columns[split] = next(csv.reader(header), []) if header else []
        return self._columns[split]

    def write(self, row: dict) -> None:
        """Append the row to its split's file, rewriting the file with a wider header when a new metric appears."""
        split = str(row.get("split", "train"))
        values = {k: v for k, v in row.items() if k != "split"}
        columns = self._known_columns(split)
        path = self._path(split)
        try:
            if not columns or set(values) - set(columns):
                self._rewrite(split, columns + [k for k in values if k not in columns])
            buf = io.StringIO()
            csv.DictWriter(buf, self._columns[split], lineterminator="\n").writerow(values)
            append_line(path, buf.getvalue())
        except OSError as err:
            raise storage_error("writing", path, err) from err

    def _rewrite(self, split: str, columns: list[str]) -> None:
        path = self._path(split)
        old = list(csv.DictReader(path.open())) if path.is_file() else []
        buf = io.StringIO()
        writer = csv.DictWriter(buf, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(old)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(buf.getvalue())
        tmp.replace(path)
        self._columns[split] = columns

    def close(self) -> None:
        """Nothing to release: each row is appended and closed as it is written."""
        pass


class TensorBoardWriter:
    """Event files under `<run_dir>/tensorboard`, one scalar per metric tagged `<split>/<metric>`."""

    def __init__(self, run_dir: PathLike):
        from jaxnn._src.optional import require

        try:
            SummaryWriter = require("tensorboardX", "metric writer 'tensorboard'").SummaryWriter
        except ImportError as err:  # a ValueError: bad settings are refused before the run writes anything
            raise ValueError(str(err)) from None
        self.logdir = pathlib.Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(logdir=str(self.logdir))

    def write(self, row: dict) -> None:
        """One scalar per numeric metric at the row's step, flushed so TensorBoard sees it at once."""
        split, step = row.get("split", "train"), int(row["step"])
        for name, value in row.items():
            if name not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{split}/{name}", float(value), step)
        self._writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self._writer.close()


def check_writer_names(names: Iterable[str]) -> tuple[str, ...]:
    """The names as a tuple, or a ValueError naming the unknown ones and the writers there are."""
    names = tuple(names)
    unknown = [n for n in names if n not in WRITERS]
    if unknown:
        raise ValueError(f"unknown metric writer(s) {unknown}; choose from {list(WRITERS)}")
    for name in names:  # refused with the settings, before a run directory is touched
        if name in LIBRARIES and not importable(LIBRARIES[name]):
            raise ValueError(f"metric writer {name!r} needs {LIBRARIES[name]}: {hint(LIBRARIES[name])}")
    return names


def make_writers(
    names: Iterable[str],
    run_dir: PathLike,
    *,
    run_id: str | None = None,
    run_name: str | None = None,
    config: dict | None = None,
) -> list[MetricWriter]:
    """The writers named in `names` (JSON lines is always included) for `run_dir`. The tracking services' writers
    take the run's id (kept when a run directory is resumed), its name (else the run directory's) and its config."""
    names = check_writer_names(names)
    run_dir = pathlib.Path(run_dir)
    writers: list[MetricWriter] = [JsonlWriter(run_dir / "metrics.jsonl")]
    if "csv" in names:
        writers.append(CsvWriter(run_dir))
    if "tensorboard" in names:
        writers.append(TensorBoardWriter(run_dir))
    run_name = run_name or run_dir.name
    try:
        for name in (n for n in ("wandb", "mlflow") if n in names):
            writers.append(make_service_writer(name, run_dir, run_id=run_id, run_name=run_name, config=config or {}))
    except BaseException:  # a service that fails to start leaves none started
        for writer in writers:
            writer.close()
        raise
    return writers
