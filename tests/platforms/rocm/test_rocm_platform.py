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
