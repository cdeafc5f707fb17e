"""Warnings that point at the user's line, not at jaxnn's: the frame a warning names is the first one outside the
jaxnn package (Python 3.12's `skip_file_prefixes`, by hand for 3.11). Internal."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the innermost caller outside jaxnn."""
    level = 2  # stacklevel 2 is the caller of this function
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
