"""Build C sources under ``csrc/`` into shared libraries at first use and load them.

Each source is compiled with the system C compiler for the host CPU and cached under
``cache_dir()/cpu_kernels``; the file name hashes everything the binary depends on (source,
flags, compiler version, CPU flags), so a change to any of them gets its own build. OpenMP
comes from ``-fopenmp`` and resolves to the libgomp torch has already loaded, so kernels and
torch share one thread pool. When no compiler works, ``load_library`` returns None and logs
one line per source; callers keep their torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from pagedserve import envs
from pagedserve.logger import get_logger

logger = get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMPILER = "cc"
# -fno-trapping-math: nothing enables floating-point traps, and without it GCC will not turn a
# clamp (x < a ? a : x) into a vector max, which keeps exp loops scalar.
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


def library_path(source: Path, text: bytes | None = None) -> Path:
    """Where the library built from ``source`` (or from ``text`` in its place) is cached."""
    digest = hashlib.sha256(source.read_bytes() if text is None else text)
    for part in (" ".join(FLAGS), _compiler_version(COMPILER), _cpu_flags()):
        digest.update(b"\0" + part.encode())
    return envs.cache_dir() / "cpu_kernels" / f"{source.stem}-{digest.hexdigest()[:20]}.so"


def load_library(source: Path) -> ctypes.CDLL | None:
    """The loaded library built from ``source``, building it first if it is not cached; None
    (logged once) if it does not build or load. Callers cache the result and set argtypes."""
    return _load(source, library_path(source))


@functools.cache
def _load(source: Path, path: Path) -> ctypes.CDLL | None:
    try:
        if not path.exists():
            _build(source, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()
        logger.warning("native CPU kernels of %s unavailable, using torch ops: %s", source.name,
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


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine


def _build(source: Path, path: Path) -> None:
    """Compile into a temporary file beside ``path`` and rename it into place, so a process
    that builds concurrently never loads a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([COMPILER, *FLAGS, str(source), "-o", tmp], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built native CPU kernels: %s", path)
