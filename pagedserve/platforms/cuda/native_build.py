"""The CUDA toolchain for the CUDA C++ sources under ``csrc/``: the machine's ``nvcc``, for the
GPU's own architecture (``-arch=sm_XY``: with no target named, nvcc embeds older machine code
and none of the newer instructions), cached under ``cache_dir()/cuda_kernels``
(``platforms/native_build.py`` builds, caches and loads). Each library links its own CUDA
runtime statically and is called through ctypes on torch's stream, so it depends on neither
torch's C++ ABI nor a build system. Without ``nvcc`` (or where the source does not build)
``load_library`` returns None, logged once, and callers keep their Triton kernels.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

from pagedserve import envs
from pagedserve.platforms import native_build

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC")


def nvcc() -> str:
    """The compiler to run: CUDA_HOME's, else the first on PATH, else /usr/local/cuda's (which
    may be missing: the build then fails and is logged)."""
    home = envs.cuda_home()
    if home:
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def load_library(source: Path, capability: tuple[int, int], defines: tuple[str, ...] = (),
                 arch_specific: bool = False) -> ctypes.CDLL | None:
    """The library built from ``source`` for GPUs of ``capability`` (built first if it is not
    cached), or None. ``defines`` (``NAME`` or ``NAME=VALUE``) select compiled variants.
    ``arch_specific``: for that architecture's own instructions (``sm_90a``: Hopper's wgmma),
    machine code for it alone, with no PTX that a later GPU could compile without them."""
    arch = f"sm_{capability[0]}{capability[1]}"
    target = (f"-gencode=arch=compute_{arch[3:]}a,code={arch}a" if arch_specific
              else f"-arch={arch}")
    flags = (*FLAGS, target, *(f"-D{d}" for d in defines))
    tc = native_build.Toolchain(nvcc(), flags, arch, "cuda_kernels", "using the Triton kernels")
    return native_build.load_library(tc, source)
