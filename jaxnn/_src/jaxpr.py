"""Which inputs a traced program reads: the analysis behind refusing settings that would have no effect (LoRA
adapters no Dense multiplies, mixed targets a loss never reads). Internal."""

from __future__ import annotations

from typing import Any


def used_inputs(jaxpr: Any) -> set[int]:
    """Indices of `jaxpr`'s inputs that reach its outputs or effects, looking inside scans, remat and calls
    whose inner program takes the same operands (other control flow counts every operand as used)."""
    live = {v for v in jaxpr.outvars if _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and not any(v in live for v in eqn.outvars):
            continue
        inner = _inner_program(eqn)
        if inner is not None and len(inner.invars) == len(eqn.invars):
            kept = used_inputs(inner)
            operands = [v for i, v in enumerate(eqn.invars) if i in kept]
        else:
            operands = list(eqn.invars)
        live.update(v for v in operands if _is_var(v))
    return {i for i, v in enumerate(jaxpr.invars) if v in live}


def _is_var(v: Any) -> bool:
    return not hasattr(v, "val")  # a Literal holds a value; a Var does not


def _inner_program(eqn: Any) -> Any:
    programs = [p for p in eqn.params.values() if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
    if len(programs) != 1:
        return None
    return programs[0] if hasattr(programs[0], "eqns") else programs[0].jaxpr
