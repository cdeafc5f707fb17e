"""The peak a report or benchmark divides by: at least every rate measured in the same run for that dtype and device.

A peak is one large product's fastest timing window (`jaxnn.profile.timing.measure_matmul_peak`). On a shared
machine that window can catch another process's load, and other shapes can run faster than the peak's size (a
1024^3 bf16 product above the 2048^3 one, a GPT step's products above both). Dividing by such a peak prints
"131% of peak". So the ceiling is the larger of the peak measurement and every rate of the run, and where a rate
raised it, `Ceiling.note` names that rate and the measurement it replaced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Ceiling:
    """The rate to divide by (`gflops`), the peak measurement (`measured`, None when there was none) and, where a
    rate of the run beat that measurement, which one (`raised_by`)."""

    gflops: float
    measured: float | None
    raised_by: str | None = None

    @property
    def note(self) -> str:
        """Why the ceiling is not the peak measurement ("" where it is)."""
        if self.raised_by is None:
            return ""
        was = "no peak measurement" if self.measured is None else f"the peak measurement read {self.measured:,.0f}"
        return f"raised to {self.raised_by}'s {self.gflops:,.0f} GFLOP/s ({was})"


def ceiling(measured: float | None, rates: Iterable[tuple[str, float | None]]) -> Ceiling | None:
    """The ceiling over a peak measurement and the run's `(label, GFLOP/s)` rates of the same dtype and device;
    None when there is neither."""
    best = max(((gflops, label) for label, gflops in rates if gflops is not None), default=None)
    if best is not None and (measured is None or best[0] > measured):
        return Ceiling(best[0], measured, best[1])
    return None if measured is None else Ceiling(measured, measured)
