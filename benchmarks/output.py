"""Where a benchmark writes its JSON: `--json PATH` never replaces a file already there unless `--overwrite` says so.

results/bench/ holds committed measurements that docs/performance.md cites; a rerun under the same name would
replace one silently. The make targets pass fresh, dated names instead (mk/bench.mk).
"""

from __future__ import annotations

import argparse
import os

from experiments.common import params_label  # noqa: F401 (the benchmarks' tables use it from here too)


def add_json_flags(parser: argparse.ArgumentParser, help: str = "also write the results here as JSON") -> None:
    """`--json PATH` (refused when PATH exists) and `--overwrite` (replace it all the same)."""
    parser.add_argument("--json", default=None, metavar="PATH", help=f"{help}; refused if PATH exists")
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")


def refuse_existing(*paths: str | None, overwrite: bool) -> None:
    """Exits (status 1, one line on stderr) when a path given exists and `overwrite` is not set: called before
    measuring, so no run is spent on a result it may not write."""
    taken = [p for p in paths if p and os.path.exists(p)]
    if taken and not overwrite:
        raise SystemExit(
            f"error: {taken[0]} exists (a committed result?); pass --overwrite to replace it or give a new PATH"
        )
