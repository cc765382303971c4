"""The CUDA C++ W4A16 kernels (``csrc/w4a16_mma.cu``): on the CPU, that their source builds
with the machine's ``nvcc`` (where there is one) and how they split K; on an NVIDIA GPU,
against a float64 reference at every group size, odd M, N and K off the block sizes, both
16-bit types, each kernel and block of rows, with and without split K. Outputs are poisoned
with NaN, so a missed write shows; the split-K counters must be back at zero after each call,
or the next call's sums are wrong.
"""

from __future__ import annotations

import ctypes
import re
import shutil

import pytest
import torch

from pagedserve.platforms.cuda import native_build
from pagedserve.platforms.cuda.kernels import w4a16_mma, w4a16_wgmma
from tests.devices import HAS_NVIDIA, NVIDIA_REASON

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(native_build.nvcc()) is None, reason="no nvcc here")
@pytest.mark.parametrize("sweep", [False, True])
def test_source_builds_for_sm90(sweep, check_build):
    """What only nvcc rejects (PTX operands, templates) fails here, not on the GPU machine.
    The library loads without a GPU: its CUDA runtime is linked in and starts at first use."""
    lib = native_build.load_library(w4a16_mma.SOURCE, (9, 0),
                                    ("W4A16_MMA_SWEEP",) if sweep else ())
    assert lib is not None
    assert lib.w4a16_mma_variants() == (4 if sweep else 1)
    assert [p.name.split("-")[0] for p in (check_build / "cuda_kernels").iterdir()] == [
        "w4a16_mma"]


def test_ctypes_args_mirror_the_struct():
    """``Args`` must list ``W4A16MmaArgs``'s fields (``csrc/w4a16_args.h``, both libraries')
    in its order and types, or a kernel reads one field as another (a device index as the
    rows per block, say)."""
    source = w4a16_mma.ARGS_HEADER.read_text()
    body = re.search(r"struct W4A16MmaArgs \{(.*?)\n\};", source, re.S).group(1)
    fields = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            kind, names = re.match(r"((?:const )?\w+\*?)\s+(.*)", decl).groups()
            fields += [(n.strip(), "*" in kind) for n in names.split(",")]
    assert fields == [(name, ctype is ctypes.c_void_p)
                      for name, ctype in w4a16_mma.Args._fields_]
    for source in (w4a16_mma.SOURCE, w4a16_wgmma.SOURCE):
        assert '#include "w4a16_args.h"' in source.read_text()


def test_library_path_covers_the_included_header(tmp_path, monkeypatch):
    """A change to the shared header must give both libraries a new build, not a cached one
    compiled against the old struct."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    from pagedserve.platforms import native_build as shared

    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("w4a16_args.h", "w4a16_mma.cu"):
        (folder / name).write_bytes((native_build.CSRC / name).read_bytes())
    tc = shared.Toolchain("nvcc", ("-O3",), "sm_90", "cuda_kernels", "")
    before = shared.library_path(tc, folder / "w4a16_mma.cu")
    assert shared.library_path(tc, folder / "w4a16_mma.cu") == before
    header = folder / "w4a16_args.h"
    header.write_text(header.read_text().replace("int device;", "int device, spare;"))
    assert shared.library_path(tc, folder / "w4a16_mma.cu") != before


def test_missing_nvcc_gives_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert native_build.nvcc() == str(tmp_path / "no-cuda" / "bin" / "nvcc")
    assert native_build.load_library(w4a16_mma.SOURCE, (9, 0)) is None
    assert not list(tmp_path.glob("cuda_kernels/*"))


@pytest.mark.parametrize("m,n,tiles,split_k", [(1, 4096, 32, None), (16, 4096, 112, None),
                                               (8, 28672, 32, None), (1, 576, 5, None),
                                               (9, 4096, 112, 1), (1, 4096, 3, 8)])
def test_plan_covers_k_within_shared_memory(m, n, tiles, split_k):
    """The few-rows kernel (forced from 9 rows, which the many-rows kernel takes)."""
    _, per_split, splits = w4a16_mma.plan(m, n, tiles, 132, n // 64, split_k, rows=0)
    assert per_split * splits >= tiles > per_split * (splits - 1)  # no empty split
    assert min(m, 16) * (per_split * 128 + 32) * 2 <= w4a16_mma.X_BYTES  # the staged x fits
    if split_k is None:  # enough blocks, unless K runs out of tiles
        assert splits * -(-n // w4a16_mma.BLOCK_N) >= min(
            w4a16_mma.PROGRAMS_PER_SM * 132, tiles * -(-n // w4a16_mma.BLOCK_N))


@pytest.mark.parametrize("m,n,tiles,rows,splits", [
    # 32 blocks of the output aim at 132 (one per multiprocessor): 5 splits of 32 tiles, of
    # 6 tiles each, are 6
    (17, 4096, 32, 32, 6),
    (64, 28672, 32, 32, 1),  # 2 x 224 blocks: more than a multiprocessor each
    (100, 4096, 112, 64, 4),  # 2 blocks of rows by 32: 3 splits of 37 tiles are 4
    (200, 4096, 112, 64, 1)])  # 4 x 32 blocks, more than the 64 counters: one split
def test_plan_many_rows(m, n, tiles, rows, splits):
    plan = w4a16_mma.plan(m, n, tiles, 132, n // 64)
    assert plan.block_rows == rows
    assert plan.tiles_per_split * plan.splits >= tiles > plan.tiles_per_split * (plan.splits - 1)
    assert plan.splits == splits


def _weight(n: int, k: int, group: int, seed: int):
    from tests.platforms.cuda.test_w4a16 import random_weight

    return random_weight(n, k, group, seed=seed, style="awq")


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [32, 64, 128, 256, None], ids=lambda g: f"g{g or 'all'}")
@pytest.mark.parametrize("m,rows", [(1, 0), (3, 0), (8, 0), (9, 0), (16, 0), (9, 16),
                                    (16, 16), (17, 32), (33, 64), (64, 64), (100, 64),
                                    (130, 64), (257, 64)])
def test_matches_reference_cuda(m, rows, group, dtype):
    from pagedserve.platforms.cuda.kernels import w4a16
    from tests.platforms.cuda.test_w4a16 import assert_close, reference

    # N: 37 blocks of 128 and one of 32 features; K: 32 tiles and half of one more.
    n, k = 4768, 4160
    weight = _weight(n, k, group or k, seed=m + (group or 0))
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, weight.group_size,
                        torch.device("cuda"))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
    assert w4a16_mma.eligible(x, packed)
    ref = reference(x, weight)
    for split_k in (1, 5, None):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        assert w4a16_mma.matmul(x, packed, out, split_k, rows=rows) is out
        assert not packed.counters.any()
        assert_close(out, ref, dtype)


def check_strided_rows_and_output(path: str, m: int) -> None:
    """x rows a padded stride apart, and an output view at an odd column, whose rows the CUDA
    C++ kernels cannot store two or four at a time (it goes through a copy)."""
    from pagedserve.platforms.cuda.kernels import w4a16
    from tests.platforms.cuda.test_w4a16 import assert_close, reference

    weight = _weight(256, 512, 128, seed=3)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, torch.device("cuda"))
    wide = torch.randn(m, 520, device="cuda", dtype=torch.bfloat16)
    x = wide[:, :512]
    big = torch.full((m, 258), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[:, 1:257]
    w4a16.matmul(x, packed, out=out, path=path)
    assert_close(out, reference(x, weight), torch.bfloat16)
    assert big[:, 0].isnan().all() and big[:, 257].isnan().all()


@cuda
@needs_cuda
def test_strided_rows_and_output_cuda():
    check_strided_rows_and_output("mma", 5)


@cuda
@needs_cuda
def test_chosen_where_built_cuda():
    """On an NVIDIA GPU with nvcc, 16-bit rows in ``w4a16.MMA_ROWS`` take this kernel; one
    row, more rows, float32 x and offsets (GGUF) take the Triton paths."""
    from pagedserve.platforms.cuda.kernels import w4a16
    from tests.platforms.cuda.test_w4a16 import random_weight

    assert w4a16_mma.library(torch.cuda.get_device_capability()) is not None
    awq = random_weight(256, 512, 128, seed=1, style="awq")
    gguf = random_weight(256, 512, 128, seed=1, style="gguf")
    pa, pg = (w4a16.pack(w.values, w.scales, w.offsets, 128, torch.device("cuda"))
              for w in (awq, gguf))
    for m, dtype, packed, path in [(2, torch.bfloat16, pa, "mma"), (8, torch.float16, pa, "mma"),
                                   (1, torch.bfloat16, pa, "gemv"),
                                   (9, torch.bfloat16, pa, "mma"),
                                   (16, torch.float16, pa, "mma"),
                                   (17, torch.bfloat16, pa, "tiles"),
                                   (2, torch.float32, pa, "tiles"),
                                   (4, torch.bfloat16, pg, "tiles")]:
        x = torch.ones(m, 512, device="cuda", dtype=dtype)
        assert w4a16._choose_path(x, packed) == path, (m, dtype)
