"""The native CPU quant kernels against a float64 reference built from values, scales and
offsets directly (not through ``pack``), and the build cache that holds the library."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.platforms.cpu import native_build, native_quant

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """The library built into an empty cache folder, so no test leans on a warm ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        native_quant._library.cache_clear()
        if not native_quant.available():
            pytest.skip("no working C compiler for the native kernels (see the log)")
        yield native_quant.library_path()
    native_quant._library.cache_clear()


def quantized(n: int, k: int, bits: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    values = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    offsets = torch.randn(n, groups, generator=gen) * 0.1
    return values, scales, offsets


def reference(x: torch.Tensor, values, scales, offsets, group_size: int) -> torch.Tensor:
    group = torch.arange(values.shape[1]) // group_size
    w = values.double() * scales.double()[:, group] + offsets.double()[:, group]
    return x.double() @ w.T, w


# (n, k, group size): K=100 leaves a short last group of 4; 5 is odd and not a multiple of
# the kernel's 4-column step; k=576 with group k is per-channel.
SHAPES = [(19, 100, 32), (33, 256, 128), (9, 576, 576), (1001, 37, 5)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group_size", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17, 300])
@pytest.mark.parametrize("path", ["gemv", "dequant"])
def test_matmul_matches_float64(built, monkeypatch, bits, n, k, group_size, m, path):
    # Both kernels run at every m, whatever the crossover is.
    monkeypatch.setattr(native_quant, "GEMV_MAX_ROWS", 10**9 if path == "gemv" else 0)
    values, scales, offsets = quantized(n, k, bits, group_size)
    w = native_quant.pack(values, scales, offsets, bits, group_size)
    first, second = torch.randn(2, m, k).unbind()
    native_quant.matmul(first, w)
    # Freed NaNs are likely to be handed back as the next output: uninitialised lanes show.
    del first
    torch.full((m, n), float("nan"))
    y = native_quant.matmul(second, w)
    expected, w64 = reference(second, values, scales, offsets, group_size)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    # float32 accumulation: error within a few dozen ulps of the sum of |terms|.
    bound = second.double().abs() @ w64.abs().T
    assert ((y.double() - expected).abs() <= 64 * 2**-24 * bound).all()


def test_matmul_takes_a_non_contiguous_x(built):
    values, scales, offsets = quantized(24, 64, 4, 32)
    w = native_quant.pack(values, scales, offsets, 4, 32)
    x = torch.randn(64, 5).T
    expected, _ = reference(x, values, scales, offsets, 32)
    torch.testing.assert_close(native_quant.matmul(x, w).double(), expected, rtol=1e-5,
                               atol=1e-5)


def test_weight_lists_every_tensor_it_holds(built):
    w = native_quant.pack(*quantized(10, 42, 4, 32), bits=4, group_size=32)
    held = {name for name in w.__slots__ if isinstance(getattr(w, name), torch.Tensor)}
    assert set(w.tensors()) == held
    # Two nibbles a byte, 10 rows padded to 16, the last group of 10 columns to 12.
    assert w.tensors()["qweight"].numel() == 16 * 44 // 2


def test_pack_rejects_what_the_kernel_cannot_read():
    values, scales, offsets = quantized(8, 64, 4, 32)
    with pytest.raises(ValueError, match="bits 4 or 8"):
        native_quant.pack(values, scales, offsets, 3, 32)
    with pytest.raises(ValueError, match="scales/offsets"):
        native_quant.pack(values, scales[:, :1], offsets, 4, 32)


def test_cache_key_follows_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    source = native_quant.SOURCE.read_bytes()
    path = native_quant.library_path(source)
    assert path.parent == tmp_path / "cpu_kernels"
    assert native_quant.library_path(source + b"\n/* changed */\n") != path
    assert native_quant.library_path() == path


def test_fresh_process_reuses_the_cached_library(built):
    before = built.stat().st_mtime_ns
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(built.parent.parent), "PYTHONPATH": str(REPO)}
    code = ("from pagedserve.platforms.cpu import native_quant as q; "
            "assert q.available(); print(q.library_path())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == str(built)
    assert built.stat().st_mtime_ns == before
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp files left


def test_missing_compiler_reports_unavailable_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "COMPILER", str(tmp_path / "no-such-cc"))
    native_quant._library.cache_clear()
    logger = logging.getLogger("pagedserve")
    logger.addHandler(caplog.handler)  # the package logger does not propagate to the root
    try:
        assert not native_quant.available()
        assert not native_quant.available()
    finally:
        logger.removeHandler(caplog.handler)
        native_quant._library.cache_clear()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert not list(tmp_path.glob("cpu_kernels/*"))
