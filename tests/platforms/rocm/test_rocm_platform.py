"""RocmPlatform's architecture-dependent choices, with the GPU's gfx name faked."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ConfigError
from pagedserve.platforms.rocm import platform as rocm

pytestmark = pytest.mark.rocm


@pytest.fixture
def arch(monkeypatch):
    def set_arch(name: str) -> None:
        monkeypatch.setattr(rocm, "_gcn_arch", lambda: name)
    return set_arch


@pytest.mark.parametrize("name,fp8", [("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),
                                      ("gfx950", torch.float8_e4m3fn)])
def test_fp8_matmul_dtype_by_architecture(arch, name, fp8):
    arch(name)
    assert rocm.RocmPlatform.supports_fp8_matmul()
    assert rocm.RocmPlatform.fp8_dtype() == fp8


def test_no_fp8_matmul_before_mi300(arch):
    arch("gfx90a:sramecc+:xnack-")
    assert not rocm.RocmPlatform.supports_fp8_matmul()


@pytest.mark.parametrize("name", ["gfx90a", "gfx942:sramecc+:xnack-", "gfx1100"])
def test_fp8_kv_cache_refused_naming_the_architecture(arch, name):
    arch(name)
    with pytest.raises(ConfigError, match=rf"rocm \({name.split(':')[0]}\).*use auto"):
        rocm.RocmPlatform.kv_cache_torch_dtype("fp8", torch.bfloat16)
    assert rocm.RocmPlatform.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16


@pytest.fixture
def hip(monkeypatch):
    """A ROCm build of torch: ``torch.version.hip`` set; whether it sees a GPU is the
    argument."""
    def set_gpu(visible: bool) -> None:
        monkeypatch.setattr(torch.version, "hip", "6.2.41133")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    return set_gpu


def test_rocm_build_with_a_gpu_selects_rocm_never_cuda(hip, monkeypatch):
    from pagedserve import platforms
    from pagedserve.platforms.cuda.platform import CudaPlatform
    from pagedserve.platforms.interface import PlatformUnavailable

    pytest.importorskip("triton")
    hip(True)
    assert platforms.resolve_platform("rocm") is rocm.RocmPlatform
    with pytest.raises(PlatformUnavailable, match="no CUDA device"):
        CudaPlatform.check_available()  # ROCm's torch.cuda is HIP: not an NVIDIA GPU
    # auto: cuda is skipped, rocm chosen before hpu and cpu are tried.
    assert platforms.resolve_platform("auto") is rocm.RocmPlatform


def test_rocm_refusals_name_what_is_missing(hip, monkeypatch):
    from pagedserve.platforms.interface import PlatformUnavailable

    hip(False)
    with pytest.raises(PlatformUnavailable, match="^no ROCm device: torch sees no AMD GPU$"):
        rocm.RocmPlatform.check_available()
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(PlatformUnavailable, match="this torch build .* has no HIP support"):
        rocm.RocmPlatform.check_available()


def test_rocm_without_triton_says_how_to_install(hip, monkeypatch):
    import sys

    from pagedserve.platforms.interface import PlatformUnavailable

    hip(True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(PlatformUnavailable, match="pip install pytorch-triton-rocm"):
        rocm.RocmPlatform.check_available()
