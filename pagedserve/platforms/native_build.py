"""Build a kernel source into a shared library at first use, cache it, and load it (ctypes).

A ``Toolchain`` says how: the compiler, its flags, and what else the binary depends on (the
host CPU's flags, the GPU's architecture). The cached file's name hashes all of it with the
source and the compiler's version, so a change to any of them gets its own build; a build
goes to a temporary file renamed into place, so a process that builds concurrently never
loads a half-written library. When the compiler is missing or the source does not build,
``load_library`` returns None and logs one line per source; callers keep their fallbacks.
Platforms hold their toolchains (``cpu/native_build.py``, ``cuda/native_build.py``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve import envs
from pagedserve.logger import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Toolchain:
    compiler: str
    flags: tuple[str, ...]  # ending where the output file's path follows
    target: str  # what else the binary depends on, hashed into its name
    subdir: str  # under ``envs.cache_dir()``
    fallback: str  # what callers do without the library, for the log line


def library_path(tc: Toolchain, source: Path, text: bytes | None = None) -> Path:
    """Where the library built from ``source`` (or from ``text`` in its place) is cached. The
    headers it includes by quoted name from its own folder count as part of it."""
    text = source.read_bytes() if text is None else text
    digest = hashlib.sha256(text)
    for header in _local_headers(source.parent, text):
        digest.update(b"\0" + header.read_bytes())
    for part in (" ".join(tc.flags), _compiler_version(tc.compiler), tc.target):
        digest.update(b"\0" + part.encode())
    return envs.cache_dir() / tc.subdir / f"{source.stem}-{digest.hexdigest()[:20]}.so"


def _local_headers(folder: Path, text: bytes) -> list[Path]:
    """The files that ``text`` includes as ``#include "name"`` from ``folder``, and theirs."""
    found, unread = [], [text]
    while unread:
        for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', unread.pop(), re.M):
            path = folder / name.decode()
            if path.is_file() and path not in found:
                found.append(path)
                unread.append(path.read_bytes())
    return found


def load_library(tc: Toolchain, source: Path) -> ctypes.CDLL | None:
    """The loaded library built from ``source``, building it first if it is not cached; None
    (logged once) if it does not build or load. Callers cache the result and set argtypes."""
    return _load(tc, source, library_path(tc, source))


@functools.cache
def _load(tc: Toolchain, source: Path, path: Path) -> ctypes.CDLL | None:
    try:
        if not path.exists():
            _build(tc, source, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()
        logger.warning("native kernels of %s unavailable, %s: %s", source.name, tc.fallback,
                       detail.splitlines()[0] if detail else type(e).__name__)
        return None


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              check=True)
    except (OSError, subprocess.CalledProcessError):
        return "missing"
    return done.stdout


def _build(tc: Toolchain, source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([tc.compiler, *tc.flags, str(source), "-o", tmp], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built native kernels: %s", path)
