"""Sharding rules: an ordered table of parameter-path patterns -> partition specs over the mesh axes.

A rule is `(pattern, spec)`. The pattern is matched against a parameter's dotted name (`jaxnn._src.pytree.path_name`,
e.g. `"2_block.1_mlp.1_fc.w"`): a shell-style glob (`"*fc.w"`, `*` crosses dots), or a regular expression when it
starts with `re:` (`"re:(.*\\.)?(\\d+_)?fc\\.w"`), which must match the whole name. The first rule that matches
decides; a parameter no rule matches is whole along every axis but fsdp. A rule that matches no parameter of the
model is refused by the layout report (a misspelt pattern would otherwise shard nothing, silently), unless the table
says `allow_unmatched` (`ShardingRules(..., allow_unmatched=True)`, or `"allow_unmatched": true` in a JSON table).

The spec names the parameter's *last* `len(spec)` dimensions, each `None`, an axis name or a list of axis names,
so that one rule also covers `Repeat`'s stacked parameters (a leading layer axis stays whole). Axes the mesh lacks
or has with size 1 are dropped. Then FSDP: unless the spec already names `fsdp`, a parameter of at least
`fsdp_min_size` elements is split over `fsdp` along its largest free dimension that fsdp divides.

jaxnn's own layers are covered by `BUILT_IN`, an ordinary table: Megatron tensor parallelism for attention's
q/k/v and the MLP's first layer (by output columns) and for attention's output and the MLP's second layer (by
input rows).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec as P

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
AXES = (DATA, FSDP, TENSOR)
REGEX_PREFIX = "re:"
ALLOW_UNMATCHED = "allow_unmatched"  # the option's key among a table's patterns: a bool is never a spec

DimSpec = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Rule:
    """One row of a table: the pattern as given, its compiled form and the spec of the trailing dimensions."""

    pattern: str
    regex: re.Pattern[str]
    spec: tuple[DimSpec, ...]


@dataclass(frozen=True)
class ShardingRules:
    """An ordered rule table. `name` appears in the layout report, its warnings and errors; `allow_unmatched` lets
    a rule match no parameter of the model (`BUILT_IN`, a catalogue for every built-in layer, or a table shared by
    several models); otherwise the layout report refuses the table."""

    rules: tuple[Rule, ...]
    name: str = "user rules"
    fsdp_min_size: int = 1024  # smaller parameters (norm scales, biases) would cost a collective each for nothing
    allow_unmatched: bool = False

    def match(self, name: str) -> Rule | None:
        """The first rule whose pattern matches the dotted parameter name, or None."""
        return next((r for r in self.rules if r.regex.fullmatch(name)), None)

    def spec(self, name: str, shape: tuple[int, ...], sizes: Mapping[str, int]) -> P:
        """The PartitionSpec of parameter `name` of `shape` on a mesh of axis `sizes`; ValueError (one line naming
        the parameter, its shape, the rule and the axis) when the rule cannot apply."""
        dims: list[tuple[str, ...]] = [()] * len(shape)
        rule = self.match(name)
        if rule is not None:
            if len(rule.spec) > len(shape):
                raise ValueError(
                    f"sharding rule {rule.pattern!r} ({self.name}): spec {list(rule.spec)} has {len(rule.spec)} "
                    f"dimensions, parameter {name!r} of shape {shape} has {len(shape)}"
                )
            for offset, entry in enumerate(rule.spec):
                dim = len(shape) - len(rule.spec) + offset
                dims[dim] = tuple(a for a in _axes_of(entry) if sizes.get(a, 1) > 1)
                split = math.prod(sizes[a] for a in dims[dim])
                if shape[dim] % split:
                    axes = " x ".join(map(repr, dims[dim]))
                    raise ValueError(
                        f"sharding rule {rule.pattern!r} ({self.name}): parameter {name!r} of shape {shape} cannot "
                        f"be split over mesh axis {axes} ({split} devices): dimension {dim} has size {shape[dim]}"
                    )
        fsdp = sizes.get(FSDP, 1)
        named = {a for d in dims for a in d}
        if fsdp > 1 and FSDP not in named and math.prod(shape) >= self.fsdp_min_size:
            free = [d for d in range(len(shape)) if not dims[d] and shape[d] % fsdp == 0]
            if free:
                dims[max(free, key=lambda d: (shape[d], d))] = (FSDP,)
        return P(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _axes_of(entry: DimSpec) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _compile(pattern: str) -> re.Pattern[str]:
    text = pattern[len(REGEX_PREFIX) :] if pattern.startswith(REGEX_PREFIX) else fnmatch.translate(pattern)
    try:
        return re.compile(text)
    except re.error as e:
        raise ValueError(f"sharding rule {pattern!r}: not a regular expression: {e}") from None


def _dim_spec(pattern: str, entry: Any) -> DimSpec:
    axes = [entry] if entry is None or isinstance(entry, str) else entry
    if not isinstance(axes, (list, tuple)) or not all(a is None or isinstance(a, str) for a in axes):
        raise ValueError(
            f"sharding rule {pattern!r}: each dimension is null, an axis name or a list of them, got {entry!r}"
        )
    unknown = [a for a in axes if a is not None and a not in AXES]
    if unknown:
        raise ValueError(f"sharding rule {pattern!r}: mesh axes must be among {AXES}, got {unknown}")
    if entry is None or isinstance(entry, str):
        return entry
    return tuple(a for a in axes if a is not None) or None


def rule(pattern: str, spec: Sequence[Any] | P) -> Rule:
    """One rule from a pattern and a spec (a PartitionSpec or a list of per-dimension entries), checked."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"sharding rule: a pattern must be a non-empty string, got {pattern!r}")
    if isinstance(spec, str) or not isinstance(spec, (Sequence, P)):
        raise ValueError(f"sharding rule {pattern!r}: spec must be a list of per-dimension entries, got {spec!r}")
    return Rule(pattern, _compile(pattern), tuple(_dim_spec(pattern, e) for e in spec))


RulesLike = ShardingRules | Mapping[str, Any] | Iterable[tuple[str, Any]] | str | os.PathLike[str]


def as_rules(rules: RulesLike, name: str | None = None) -> ShardingRules:
    """A `ShardingRules` from a table, a {pattern: spec} mapping (in order), (pattern, spec) pairs, or the path
    of a JSON file holding either of the latter two. An `"allow_unmatched": true` entry (or pair) among the
    rules sets `ShardingRules.allow_unmatched`."""
    if isinstance(rules, ShardingRules):
        return rules
    if isinstance(rules, (str, os.PathLike)):
        return load_rules(rules)
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"sharding rules: expected (pattern, spec) pairs, got {pair!r}")
    options = [s for p, s in pairs if p == ALLOW_UNMATCHED and isinstance(s, bool)]
    table = tuple(rule(p, s) for p, s in pairs if not (p == ALLOW_UNMATCHED and isinstance(s, bool)))
    return ShardingRules(table, name=name or "user rules", allow_unmatched=any(options))


def load_rules(path: str | os.PathLike[str]) -> ShardingRules:
    """Rules from a JSON file: `{"pattern": [spec, ...], ...}` or `[["pattern", [spec, ...]], ...]`, with an
    optional `"allow_unmatched": true` entry."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"sharding rules {os.fspath(path)!r}: cannot read a JSON table: {e}") from None
    if not isinstance(table, (dict, list)):
        raise ValueError(
            f"sharding rules {os.fspath(path)!r}: expected a JSON object or list, got {type(table).__name__}"
        )
    return as_rules(table, name=os.fspath(path))


# A layer's parameters sit under its name, numbered by the combinator holding it ("1_fc"): match the last two keys.
_END = r"re:(.*\.)?(\d+_)?"

BUILT_IN = ShardingRules(
    (
        # column-parallel: heads and hidden width split (fc of a GELU MLP, gate and up of a SwiGLU)
        rule(_END + r"(qkv|q|kv|fc|swiglu\.gate|swiglu\.up)\.w", (None, TENSOR)),
        rule(_END + r"(qkv|q|kv|fc|swiglu\.gate|swiglu\.up)\.b", (TENSOR,)),
        rule(_END + r"(out|proj|swiglu\.down)\.w", (TENSOR, None)),  # row-parallel: one all-reduce joins the shares
    ),
    name="jaxnn built-in rules",
    allow_unmatched=True,
)
