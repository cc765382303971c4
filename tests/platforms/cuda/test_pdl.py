"""Programmatic dependent launch (``platforms/cuda/kernels/pdl.py``).

On the CPU: when it is on (an NVIDIA GPU of compute capability 9.0 or later, compiled kernels;
by default in the CUDA graphs of steps of up to 8 tokens, everywhere with ``PAGEDSERVE_PDL=1``,
nowhere with ``0``), and that every kernel that takes it waits for the kernel before it
before touching global memory, read from its sm_90 PTX (``scripts/pdl_check.py``, whose
checker must also refuse a kernel that loads before its gate). The interpreter runs every
kernel with ``PDL=False`` in the other kernel tests. On a Hopper GPU: a CUDA graph of
dependent kernels, each reading what the one before wrote and writing what it read, gives the
same bits with PDL as without.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.devices import HAS_NVIDIA
from tests.sm90_check import run_check

pytest.importorskip("triton")

from pagedserve.platforms.cuda.kernels import pdl  # noqa: E402


@pytest.fixture
def fresh_options():
    pdl._mode.cache_clear()  # PAGEDSERVE_PDL is read once
    yield
    pdl._mode.cache_clear()


def test_off_on_the_cpu(fresh_options, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PDL", "1")
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


ON, OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


@pytest.mark.parametrize("mode,eager,graph_of_1,graph_of_8,graph_of_9", [
    (None, OFF, ON, ON, OFF),  # auto: small steps' graphs only
    ("auto", OFF, ON, ON, OFF),
    ("1", ON, ON, ON, ON),
    ("0", OFF, OFF, OFF, OFF),
])
def test_where_each_mode_launches_with_pdl(monkeypatch, fresh_options, mode, eager,
                                           graph_of_1, graph_of_8, graph_of_9):
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    if mode is None:
        monkeypatch.delenv("PAGEDSERVE_PDL", raising=False)
    else:
        monkeypatch.setenv("PAGEDSERVE_PDL", mode)
    device = torch.device("cuda", 0)
    assert pdl.launch_options(device) == eager
    with pdl.graph_scope(1):
        assert pdl.launch_options(device) == graph_of_1
        with pdl.graph_scope(9):
            assert pdl.launch_options(device) == graph_of_9
        assert pdl.launch_options(device) == graph_of_1  # the outer scope's again
    with pdl.graph_scope(8):
        assert pdl.launch_options(device) == graph_of_8
    assert pdl.launch_options(device) == eager


def test_a_bad_mode_is_refused_by_name(monkeypatch, fresh_options):
    from pagedserve.errors import ConfigError

    monkeypatch.setenv("PAGEDSERVE_PDL", "yes")
    with pytest.raises(ConfigError, match="PAGEDSERVE_PDL must be auto, 0 or 1"):
        pdl.launch_options(torch.device("cuda", 0))


class _FakeGraph:
    def replay(self) -> None:
        pass


def test_the_graph_runner_captures_only_small_steps_with_pdl(monkeypatch, fresh_options):
    """Each graph's warm-up and capture see the choice for its own step size: decode graphs
    of 1 to 8 sequences and a verify graph of 2 x 3 tokens with PDL, the larger without."""
    from pagedserve.platforms.cuda.graphs import CudaGraphRunner

    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    monkeypatch.delenv("PAGEDSERVE_PDL", raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    seen: dict[int, list[bool]] = {}

    def model(input_ids, positions, kv_caches, ctx):
        seen.setdefault(len(input_ids), []).append(
            pdl.launch_options(torch.device("cuda", 0))["PDL"])
        return torch.zeros(len(input_ids), 4)

    runner = CudaGraphRunner(model, [torch.zeros(1)], max_num_seqs=16, max_model_len=64,
                             block_size=16, verify_len=3)
    runner.capture()
    # Rows: decode 1, 2, 4, 8, 16; verify 3, 6, 12, 24, 48 (sizes x 3).
    assert seen == {rows: [rows <= 8] * 2 for rows in (1, 2, 4, 8, 16, 3, 6, 12, 24, 48)}
    assert pdl.launch_options(torch.device("cuda", 0)) == OFF  # eager again after capture


def test_not_supported_on_rocm_or_under_the_interpreter(monkeypatch):
    """The checks themselves (uncached: the launch caches their answer per device)."""
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert not pdl._supported.__wrapped__(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl._supported.__wrapped__(torch.device("cuda", 0))


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
        pdl._mode.cache_clear()
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
