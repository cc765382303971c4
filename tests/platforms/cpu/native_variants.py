"""Native CPU libraries built from an edited copy of a shipped C source, or with extra compiler
flags (``-mno-*`` to run a narrower instruction set's path on this CPU), in a private cache."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from pagedserve.platforms.cpu import native_build


def build_variant(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  edits: dict[str, str], flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library built from ``source`` with ``edits`` (each text must occur) and extra
    compiler ``flags``; the caller declares its functions and puts it in place."""
    text = source.read_text()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / source.name
    path.write_text(text)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))  # not the shared test cache
    monkeypatch.setattr(native_build, "FLAGS", native_build.FLAGS + flags)
    lib = native_build.load_library(path)
    assert lib is not None
    return lib
