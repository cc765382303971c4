"""Programmatic dependent launch (``platforms/cuda/kernels/pdl.py``).

On the CPU: when it is on (``PAGEDSERVE_PDL=1``, an NVIDIA GPU of compute capability 9.0 or
later, compiled kernels), and that every kernel that takes it waits for the kernel before it
before touching global memory, read from its sm_90 PTX (``scripts/pdl_check.py``, whose
checker must also refuse a kernel that loads before its gate). The interpreter runs every
kernel with ``PDL=False`` in the other kernel tests. On a Hopper GPU: a CUDA graph of
dependent kernels, each reading what the one before wrote and writing what it read, gives the
same bits with PDL as without.
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import HAS_NVIDIA
from tests.sm90_check import run_check

pytest.importorskip("triton")

from pagedserve.platforms.cuda.kernels import pdl  # noqa: E402


@pytest.fixture
def fresh_options():
    pdl.launch_options.cache_clear()
    yield
    pdl.launch_options.cache_clear()


def test_off_on_the_cpu(fresh_options):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


def test_on_where_supported_and_asked_for(monkeypatch, fresh_options):
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    device = torch.device("cuda", 0)
    monkeypatch.delenv("PAGEDSERVE_PDL", raising=False)
    assert pdl.launch_options(device) == {"PDL": False}  # off by default
    pdl.launch_options.cache_clear()
    monkeypatch.setenv("PAGEDSERVE_PDL", "1")
    assert pdl.launch_options(device) == {"PDL": True, "launch_pdl": True}


def test_not_supported_on_rocm_or_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert not pdl._supported(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl._supported(torch.device("cuda", 0))


@pytest.mark.slow
def test_every_pdl_kernel_waits_before_global_memory_on_sm90():
    run_check("pdl_check.py")


def _chain(steps: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Dependent kernels: each norm reads the output before it and adds it into the residual
    in place; rotary rewrites the output in place. Its query and key heads are disjoint (one
    kernel's programs aliasing them would race whatever the launch)."""
    from pagedserve.platforms.cuda.kernels.rms_norm import rms_norm
    from pagedserve.platforms.cuda.kernels.rotary import rotary_embedding

    for _ in range(steps):
        x, residual = rms_norm(x, weight, 1e-6, residual)
        heads = x.view(x.shape[0], -1, 128)
        rotary_embedding(positions, heads[:, :24], heads[:, 24:], cos, sin)
    return torch.cat([x, residual], dim=1)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_NVIDIA or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an NVIDIA GPU of compute capability 9.0 or later")
def test_graph_of_dependent_kernels_is_exact_with_pdl(monkeypatch, fresh_options):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, hidden = 7, 4096
    inputs = [torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
              for _ in range(3)]
    weight = inputs[2][0].clone()
    positions = torch.arange(tokens, device="cuda") * 37
    angles = torch.outer(torch.arange(512.0), 10000.0 ** (-torch.arange(64.0) / 64))
    cos, sin = angles.cos().cuda(), angles.sin().cuda()

    def replay(enabled: bool) -> torch.Tensor:
        monkeypatch.setenv("PAGEDSERVE_PDL", "1" if enabled else "0")
        pdl.launch_options.cache_clear()
        assert pdl.launch_options(inputs[0].device)["PDL"] is enabled
        x, residual = inputs[0].clone(), inputs[1].clone()
        _chain(1, x.clone(), residual.clone(), weight, positions, cos, sin)  # compile first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(100, x, residual, weight, positions, cos, sin)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    serialized = replay(False)
    torch.testing.assert_close(replay(False), serialized, rtol=0, atol=0)  # deterministic
    torch.testing.assert_close(replay(True), serialized, rtol=0, atol=0)
