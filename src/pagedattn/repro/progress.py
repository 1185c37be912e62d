"""Whether progress bars are shown: only to a person at a terminal, never in a papermill run's executed copy
(issue 51, item 6). Every tqdm bar in ``pagedattn`` asks :func:`interactive`."""
from __future__ import annotations

import sys


def interactive() -> bool:
    """True when stderr is a terminal; False in a notebook kernel, under papermill and in tests."""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False
