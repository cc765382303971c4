"""The native CPU quant kernels against a float64 reference built from values, scales and
offsets directly (not through ``pack``), and the build cache that holds the library.

The int8-activation kernel is checked twice: against its own arithmetic done in float64 (x
quantized as the kernel does, the integer dot products exact), to float32 rounding, and against
the product with unquantized x, within the worst case of rounding x to int8. Variants built
from edited source show that the first check catches a wrong offset term, and run the AVX2
(maddubs) and portable versions of the dot product on a CPU that has VNNI."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.platforms.cpu import native_build, native_quant
from tests.platforms.cpu.native_variants import build_variant

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
@pytest.mark.parametrize("kernel", ["gemv", "dequant"])
def test_float_kernels_match_float64(built, poisoned, bits, n, k, group_size, m, kernel):
    # Both kernels run at every m, whatever the crossover is.
    check_float(kernel, m, n, k, bits, group_size)


def check_float(kernel: str, m: int, n: int, k: int, bits: int, group_size: int) -> None:
    values, scales, offsets = quantized(n, k, bits, group_size)
    w = native_quant.pack(values, scales, offsets, bits, group_size)
    x = torch.randn(m, k)
    y = native_quant.run(kernel, x, w)
    expected, w64 = reference(x, values, scales, offsets, group_size)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    # float32 accumulation: error within a few dozen ulps of the sum of |terms|.
    bound = x.double().abs() @ w64.abs().T
    assert ((y.double() - expected).abs() <= 64 * 2**-24 * bound).all()


def int8_reference(x: torch.Tensor, values, scales, offsets, group_size: int):
    """The int8 kernel's result in float64 from x quantized exactly as the kernel does it
    (float32 max|x|, x * (127 / max|x|) rounded to nearest even), with the sum of |terms| of
    its final float sum, and each group's max|x| [m, n_groups]."""
    (m, k), n = x.shape, values.shape[0]
    groups = -(-k // group_size)
    pad = groups * group_size - k
    xg = F.pad(x, (0, pad)).view(m, groups, group_size)
    amax = xg.abs().amax(-1)
    # A tensor over a tensor: torch's scalar / tensor is not correctly rounded, as C's is.
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    q = torch.round(xg * inv[..., None]).double()
    d = (amax / 127).double()
    dots = torch.einsum("mgk,ngk->mng", q,
                        F.pad(values.double(), (0, pad)).view(n, groups, group_size))
    scaled = scales.double() * d[:, None] * dots
    offset = offsets.double() * (d * q.sum(-1))[:, None]
    return (scaled + offset).sum(-1), (scaled.abs() + offset.abs()).sum(-1), amax


def check_int8(m: int, n: int, k: int, bits: int, group_size: int) -> None:
    """The int8 kernel against its float64 arithmetic and against unquantized x."""
    values, scales, offsets = quantized(n, k, bits, group_size)
    w = native_quant.pack(values, scales, offsets, bits, group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[0, :group_size] = 0  # a group whose scale is 0
    x[-1, k // 2] = 40.0  # an outlier that coarsens its group's steps
    y = native_quant.run("int8", x, w)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    y = y.double()
    expected, terms, amax = int8_reference(x, values, scales, offsets, group_size)
    groups = amax.shape[1]
    # float32 per group (a few roundings) and across groups (one each).
    assert ((y - expected).abs() <= (groups + 8) * 2**-24 * terms).all()
    exact, w64 = reference(x, values, scales, offsets, group_size)
    # Each x_k moves by at most half its group's step, max|x| / 127.
    w_groups = F.pad(w64.abs(), (0, groups * group_size - k)).view(n, groups, group_size)
    step_bound = (amax.double() / 254) @ w_groups.sum(-1).T
    slack = 64 * 2**-24 * (x.double().abs() @ w64.abs().T)
    assert ((y - exact).abs() <= step_bound * (1 + 1e-5) + slack).all()


# Shapes of SHAPES and one whose K (2300) splits m = 600 into M tiles of the kernel.
INT8_SHAPES = [*SHAPES, (40, 2300, 32)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group_size", INT8_SHAPES)
@pytest.mark.parametrize("m", [1, 25, 97, 600])
def test_int8_kernel_matches_its_float64_arithmetic(built, poisoned, bits, n, k, group_size, m):
    if not native_quant.int8_supported(bits):
        pytest.skip(f"the int8 kernel takes no {bits}-bit weights on this CPU")
    check_int8(m, n, k, bits, group_size)


def variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edits: dict[str, str],
            flags: tuple[str, ...] = ()) -> None:
    """Makes native_quant use a library built from the shipped source with ``edits`` (each
    text must occur) and extra compiler ``flags``."""
    lib = build_variant(native_quant.SOURCE, tmp_path, monkeypatch, edits, flags)
    monkeypatch.setattr(native_quant, "_library", lambda: native_quant.declare(lib))


def test_int8_check_catches_a_wrong_offset_term(built, tmp_path, monkeypatch):
    # The offset term from the exact sum of x instead of the quantized one: close, not equal.
    variant(tmp_path, monkeypatch, {"xs[g] = d[g] * (float)sum;":
                                    "xs[g] = 0; for (int j = 0; j < len; j++) "
                                    "xs[g] += row[start + j];"})
    if not native_quant.int8_supported(4):
        pytest.skip("no int8 kernel on this CPU")
    with pytest.raises(AssertionError):
        check_int8(97, 33, 256, 4, 128)


@pytest.mark.parametrize("flags,bits_mask", [
    (("-mno-avxvnni", "-mno-avx512vnni"), 4),  # AVX2's maddubs: 4-bit weights only
    (("-mno-avxvnni", "-mno-avx512f"), 4),  # the same in 16 vector registers: 2-block tiles
    (("-mno-avx2",), 4 | 8),  # the portable dot product
], ids=["avx2-32-registers", "avx2", "portable"])
def test_int8_kernel_without_vnni(built, tmp_path, monkeypatch, poisoned, flags, bits_mask):
    if "avx2" not in native_build._cpu_flags().split():
        pytest.skip("an x86 CPU with AVX2 builds these variants")
    variant(tmp_path, monkeypatch, {}, flags)
    assert native_quant._library().pq_i8_bits_mask() == bits_mask
    for bits in (4, 8):
        if bits_mask & bits:
            check_int8(97, 19, 100, bits, 32)
    check_float("gemv", 17, 19, 100, 4, 32)


@pytest.mark.parametrize("kernel", native_quant.KERNELS)
def test_kernels_take_a_non_contiguous_x(built, kernel):
    values, scales, offsets = quantized(24, 64, 4, 32)
    w = native_quant.pack(values, scales, offsets, 4, 32)
    x = torch.randn(64, 5).T
    assert torch.equal(native_quant.run(kernel, x, w), native_quant.run(kernel, x.contiguous(), w))


def test_int8_rows_do_not_depend_on_their_batch(built):
    w = native_quant.pack(*quantized(40, 2300, 4, 32), bits=4, group_size=32)
    x = torch.randn(133, 2300)  # several M tiles, and a last micro-tile of one row
    y = native_quant.run("int8", x, w)
    for i in (0, 5, 100, 132):
        assert torch.equal(native_quant.run("int8", x[i:i + 1], w)[0], y[i])


def test_run_names_the_kernels_it_knows(built):
    w = native_quant.pack(*quantized(8, 64, 4, 32), bits=4, group_size=32)
    with pytest.raises(ValueError, match="gemv"):
        native_quant.run("mkl", torch.randn(2, 64), w)


def test_matmul_picks_int8_unless_told_not_to(built):
    w = native_quant.pack(*quantized(8, 64, 4, 32), bits=4, group_size=32)
    picks = {(m, int8): native_quant.kernel_for(m, w, int8) for m in (1, 600)
             for int8 in (True, False)}
    int8 = "int8" if native_quant.int8_supported(4) else None
    assert picks == {(1, True): int8 or "gemv", (600, True): int8 or "dequant",
                     (1, False): "gemv", (600, False): "dequant"}


def test_weight_lists_every_tensor_it_holds(built):
    w = native_quant.pack(*quantized(10, 42, 4, 32), bits=4, group_size=32)
    held = {name for name in w.__slots__ if isinstance(getattr(w, name), torch.Tensor)}
    assert set(w.tensors()) == held
    # Two nibbles a byte, 10 rows padded to 16, the last group of 10 columns to 16.
    assert w.tensors()["qweight"].numel() == 16 * 48 // 2


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
