"""The CPU's toolchain for the C sources under ``csrc/``: the system C compiler, for the host
CPU, cached under ``cache_dir()/cpu_kernels`` (``platforms/native_build.py`` builds, caches and
loads). OpenMP comes from ``-fopenmp`` and resolves to the libgomp torch has already loaded, so
kernels and torch share one thread pool. When no compiler works, ``load_library`` returns None
and callers keep their torch ops.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from pagedserve.platforms import native_build

CSRC = Path(__file__).parent / "csrc"
COMPILER = "cc"
# -fno-trapping-math: nothing enables floating-point traps, and without it GCC will not turn a
# clamp (x < a ? a : x) into a vector max, which keeps exp loops scalar.
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


def _toolchain() -> native_build.Toolchain:
    # Read at each call: tests swap COMPILER and FLAGS.
    return native_build.Toolchain(COMPILER, FLAGS, _cpu_flags(), "cpu_kernels",
                                  "using torch ops")


def library_path(source: Path, text: bytes | None = None) -> Path:
    """Where the library built from ``source`` (or from ``text`` in its place) is cached."""
    return native_build.library_path(_toolchain(), source, text)


def load_library(source: Path) -> ctypes.CDLL | None:
    """The loaded library built from ``source`` (built first if not cached), or None."""
    return native_build.load_library(_toolchain(), source)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine
