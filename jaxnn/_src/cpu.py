"""This machine's CPU as /proc/cpuinfo and the scheduler tell it: model name, feature flags, usable cores."""

from __future__ import annotations

import os
import pathlib
import re


def cpu_info() -> tuple[str | None, frozenset[str], int]:
    """(model name or None, the feature flags, the cores this process may run on); no model and no flags where
    /proc/cpuinfo is unreadable (not Linux)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, frozenset(), cores
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.MULTILINE)
    return (model.group(1).strip() if model else None), frozenset(flags.group(1).split() if flags else ()), cores
