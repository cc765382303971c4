"""Fixtures of the CUDA kernel tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.platforms.cuda import native_build


@pytest.fixture
def check_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CUDA C++ build on the CPU machine, only to see that nvcc and ptxas accept the source:
    cached in ``tmp_path`` (returned), so it really compiles, and with ptxas at ``-O1``. ptxas
    checks the inline PTX (wgmma operands, descriptors) at every level, and its ``-O3``, which
    the engine's build keeps, takes three times as long (38 of the wgmma build's 46 s); that
    build runs on the GPU machine in the tests that launch the kernels."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAGS", (*native_build.FLAGS, "-Xptxas", "-O1"))
    return tmp_path
