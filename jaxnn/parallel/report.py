"""The layout report: what each mesh axis splits under a rule table, read from the parameters' shapes alone.

Made before the train state exists (from `jax.eval_shape`), so a rule that cannot apply stops the run before
anything is compiled or written, and so does a rule that matches no parameter (unless the table allows it:
`ShardingRules.allow_unmatched`), naming the rules and the parameters there are. A layout that shards nothing is
said before the first step: a `tensor` or `fsdp` axis that splits no parameter is a `ShardingWarning` naming the
axis and the rule set.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxnn._src.pytree import flatten
from jaxnn._src.warn import warn_at_caller
from jaxnn.errors import ShardingWarning  # noqa: F401 (also importable from here)
from jaxnn.parallel.rules import ALLOW_UNMATCHED, FSDP, TENSOR, ShardingRules

log = logging.getLogger(__name__)

PARAMETER_AXES = (FSDP, TENSOR)  # the axes whose whole purpose is to split parameters
LARGEST_SHOWN = 3
NAMES_SHOWN = 12  # parameter names listed when a rule matches none: enough to spot the naming scheme


@dataclass(frozen=True)
class AxisReport:
    """What one mesh axis splits: parameter bytes per device counting only this axis, the parameters it splits,
    and the largest it leaves whole as (name, shape, bytes)."""

    axis: str
    size: int
    bytes_per_device: int
    split: tuple[str, ...]
    largest_unsplit: tuple[tuple[str, tuple[int, ...], int], ...]


@dataclass(frozen=True)
class LayoutReport:
    """The parameters' layout on a mesh: total bytes, bytes on each device, one `AxisReport` per axis of size > 1,
    the rules that matched nothing and the warnings the layout deserves."""

    rules: str
    total_bytes: int
    bytes_per_device: int
    axes: tuple[AxisReport, ...]
    unused_rules: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        """The report as log lines."""
        out = [f"layout ({self.rules}): parameters {self.total_bytes:,} bytes, {self.bytes_per_device:,} per device"]
        for a in self.axes:
            unsplit = ", ".join(f"{n} {list(s)} {b:,} B" for n, s, b in a.largest_unsplit) or "none"
            out.append(
                f"  {a.axis}={a.size}: {a.bytes_per_device:,} bytes per device, splits {len(a.split)} parameters; "
                f"largest left whole: {unsplit}"
            )
        return out


def layout_report(params: Any, sizes: Mapping[str, int], rules: ShardingRules) -> LayoutReport:
    """The report for a parameter tree (arrays or `jax.ShapeDtypeStruct`s) on a mesh of axis `sizes`; raises the
    rules' ValueError when one cannot apply, and one when a rule matches no parameter (`refuse_unmatched`)."""
    shapes = {name: (tuple(x.shape), int(np.dtype(x.dtype).itemsize)) for name, x in flatten(params).items()}
    specs = {name: rules.spec(name, shape, sizes) for name, (shape, _) in shapes.items()}
    nbytes = {name: math.prod(shape) * item for name, (shape, item) in shapes.items()}
    axes_of = {
        name: {a for d in spec if d for a in ((d,) if isinstance(d, str) else d)} for name, spec in specs.items()
    }

    def held(axes: set[str], name: str) -> int:
        return nbytes[name] // math.prod(sizes[a] for a in axes_of[name] & axes)

    reports, notes = [], []
    for axis, size in sizes.items():
        if size == 1:
            continue
        split = tuple(n for n in specs if axis in axes_of[n])
        whole = sorted((n for n in specs if axis not in axes_of[n]), key=lambda n: -nbytes[n])[:LARGEST_SHOWN]
        reports.append(
            AxisReport(
                axis,
                size,
                sum(held({axis}, n) for n in specs),
                split,
                tuple((n, shapes[n][0], nbytes[n]) for n in whole),
            )
        )
        if axis in PARAMETER_AXES and not split:
            notes.append(
                f"mesh axis {axis!r} ({size} devices) splits no parameter under {rules.name}: every device holds "
                f"them whole; give sharding rules that name {axis!r} (docs/parallel.md)"
            )
    unused = tuple(r.pattern for r in rules.rules if not any(r.regex.fullmatch(n) for n in specs))
    if not rules.allow_unmatched:
        refuse_unmatched(rules.name, unused, list(specs))
    return LayoutReport(
        rules.name,
        sum(nbytes.values()),
        sum(held(set(sizes), n) for n in specs),
        tuple(reports),
        unused,
        tuple(notes),
    )


def refuse_unmatched(table: str, unused: Sequence[str], names: Sequence[str]) -> None:
    """One ValueError line naming the rules that match none of the parameter `names`, and listing those names (the
    first `NAMES_SHOWN`): a misspelt pattern would otherwise leave its parameters whole, silently."""
    if not unused:
        return
    shown = ", ".join(names[:NAMES_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > NAMES_SHOWN else "")
    which = (
        "rule " + repr(unused[0]) + " matches" if len(unused) == 1 else f"rules {', '.join(map(repr, unused))} match"
    )
    raise ValueError(
        f"sharding {which} no parameter ({table}); the parameters are: {shown or 'none'}. Fix the pattern, or "
        f'allow rules that match nothing ("{ALLOW_UNMATCHED}": true in the table, docs/parallel.md)'
    )


def announce(report: LayoutReport, *, show: bool = False) -> None:
    """Logs the report, prints it to stderr too with `show` (a plain script sees it under fit's progress bar
    without configuring logging), and issues its warnings as `ShardingWarning`s at the user's line."""
    lines = report.lines()
    if show and not log.isEnabledFor(logging.INFO):
        print("\n".join(lines), file=sys.stderr)
    for line in lines:
        log.info("%s", line)
    for note in report.warnings:
        warn_at_caller(note, ShardingWarning)


def params_of(state: Any) -> Any:
    """The parameter tree of a `TrainState` (its `params`), or the tree itself."""
    return getattr(state, "params", state)
