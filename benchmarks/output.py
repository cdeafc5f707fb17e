"""Where a benchmark writes its JSON: `--json PATH` never replaces a file already there unless `--overwrite` says so.

results/bench/ holds committed measurements that docs/performance.md cites; a rerun under the same name would
replace one silently. The make targets pass fresh, dated names instead (mk/bench.mk).
"""

from __future__ import annotations

import argparse
import os


def params_label(count: float) -> str:
    """A parameter count in the unit that keeps its figure readable: "8.1k", "412k", "1.3M", "124M", "7B" (a
    fixed "M" prints a model under half a million parameters as "0M")."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.2g}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{count:.0f}"


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
