"""Paths as people type them: ``~`` and ``~user`` expanded, as a shell would."""

from __future__ import annotations

import os
from pathlib import Path


def expand_user(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; left as typed where that user (or
    the home directory) is unknown, so the caller reports a path that does not exist instead
    of ``Path.expanduser``'s RuntimeError, a traceback."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)
