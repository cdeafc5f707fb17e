"""Where a benchmark writes its JSON: `--json PATH` never replaces a file already there unless `--overwrite` says so.

results/bench/ holds committed measurements that docs/performance.md cites; a rerun under the same name would
replace one silently. The make targets pass fresh, dated names instead (mk/bench.mk). `print_rounds` is how the
A/B benchmarks print what they timed.
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


def print_rounds(tag: str, fns: dict, reference: str, rounds: int, **timing) -> None:
    """Times `fns` side by side (`jaxnn.profile.timing.time_interleaved(fns, **timing)`) `rounds` times and prints
    each round's medians with their ratios to `reference`'s: the A/B benchmarks' output."""
    from jaxnn.profile.timing import time_interleaved

    for r in range(rounds):
        timings = time_interleaved(fns, **timing)
        ref = timings[reference].median
        print(
            f"{tag}, round {r + 1}: "
            + "; ".join(f"{name} {t.median * 1e3:.4g} ms ({t.median / ref:.2f})" for name, t in timings.items())
        )
