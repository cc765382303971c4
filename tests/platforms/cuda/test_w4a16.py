"""The W4A16 Triton kernel and linear method against a float64 reference computed from the
weight's values, scales and offsets.

Without CUDA the kernel runs under Triton's interpreter: tiny shapes in float32 and float16 (the
interpreter cannot do bf16, triton-lang/triton#11584). With CUDA the ``cuda`` tests add bf16 at
Llama-3-8B sizes. Outputs are poisoned with NaN before each run, so a missed write shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.devices import HAS_NVIDIA, NVIDIA_REASON, choose_triton_interpreter, interpreter_guards
from tests.sm90_check import run_check

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

from pagedserve.quant.weights import GroupQuantWeight  # noqa: E402

if not IMPORTED_TOO_LATE:
    from pagedserve.platforms.cuda import quant_linear
    from pagedserve.platforms.cuda.kernels import w4a16

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)


_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)


def random_weight(n: int, k: int, group: int, seed: int, style: str = "awq",
                  act_order: bool = False) -> GroupQuantWeight:
    """AWQ/GPTQ style: float16 scales, integer zero points (offset ``-z * s``); GGUF style:
    float16 scale and minimum (offset ``m``)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).half().float()
    if style == "awq":
        offsets = -torch.randint(0, 16, (n, groups), generator=gen).float() * scales
    else:
        offsets = (torch.randn(n, groups, generator=gen) * 0.1).half().float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    return GroupQuantWeight(values, scales, offsets, 4, group, perm)


def reference(x: torch.Tensor, weight: GroupQuantWeight) -> torch.Tensor:
    """``x @ W.T`` in float64 straight from the fields (act-order included), computed on
    ``x``'s device and returned on the CPU."""
    dev = x.device
    groups = torch.arange(weight.shape[1], device=dev) // weight.group_size
    dense = (weight.values.to(dev).double() * weight.scales.to(dev).double()[:, groups]
             + weight.offsets.to(dev).double()[:, groups])
    x = x.double()
    if weight.input_perm is not None:
        x = x[:, weight.input_perm.to(dev)]
    return (x @ dense.T).cpu()


def run_kernel(x: torch.Tensor, weight: GroupQuantWeight, split_k: int | None = None,
               path: str | None = None):
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, weight.group_size,
                        x.device)
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype,
                     device=x.device)
    for _ in range(2):  # the split-K counters must be back at zero for the second call
        out.fill_(float("nan"))
        assert w4a16.matmul(x, packed, split_k, out, path=path) is out
        assert not packed.counters.any()
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    # float16/bf16: the dequantized weight is rounded to the activation dtype before the dot.
    rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item() + 1e-4, err


# (M, N, K, group, split_k): M across the small and the tiled configurations, K not a
# multiple of the block (100, 200), groups 32/128/per-channel, N not a multiple of the block.
INTERP_CASES = [
    (1, 40, 100, 32, None),
    (3, 64, 256, 128, 2),
    (17, 70, 96, 96, None),
    (40, 33, 200, 32, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: "m{}n{}k{}g{}s{}".format(*c))
def test_kernel_matches_reference(case, dtype):
    m, n, k, group, split_k = case
    weight = random_weight(n, k, group, seed=m, style="awq" if m % 2 else "gguf")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    assert_close(run_kernel(x, weight, split_k), reference(x, weight), dtype)


# (path, M, group, style): each path forced, with zero points and with GGUF offsets. K = 160 is
# not a multiple of the packed tile (128): its second tile is padded and masked. The GEMV takes
# groups that hold whole tiles (128, or one group of all 160 columns); the tiles groups of a
# multiple of 16, splitting them or cut unevenly (96: each slice finds its group).
PATH_CASES = [("gemv", 1, 128, "gguf"), ("gemv", 1, 160, "awq"), ("gemv", 1, 128, "awq"),
              ("tiles", 1, 32, "gguf"), ("tiles", 5, 160, "awq"),
              ("tiles", 2, 32, "awq"), ("tiles", 3, 64, "gguf"), ("tiles", 7, 96, "awq"),
              ("dequant", 6, 32, "gguf"), ("dequant", 3, 64, "awq"), ("dequant", 3, 24, "awq")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: "{}-m{}g{}-{}".format(*c))
def test_each_path_matches_reference(case, dtype):
    path, m, group, style = case
    weight = random_weight(72, 160, group, seed=m + group, style=style)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, group, x.device)
    out = torch.full((m, 72), float("nan"), dtype=dtype, device=DEVICE)
    w4a16.matmul(x, packed, out=out, path=path)
    assert not packed.counters.any()
    assert_close(out, reference(x, weight), dtype)


def test_path_choice_by_rows_and_groups():
    def packed(group, k=256):
        weight = random_weight(8, k, group, seed=1)
        return w4a16.pack(weight.values, weight.scales, weight.offsets, group,
                          torch.device("cpu"))

    def rows(m, k=256):  # float32: one row at most in the GEMV (more take bfloat16 on NVIDIA)
        return torch.ones(m, k, device=DEVICE)

    g128 = packed(128)
    assert w4a16._choose_path(rows(1), g128) == "gemv"
    assert w4a16._choose_path(rows(2), g128) == "tiles"
    assert w4a16._choose_path(rows(w4a16.DEQUANT_MIN_M - 1), g128) == "tiles"
    assert w4a16._choose_path(rows(w4a16.DEQUANT_MIN_M), g128) == "dequant"
    # Groups of 32 split a tile (the GEMV sums a tile's codes before scaling): the tiles.
    assert w4a16._choose_path(rows(1), packed(32)) == "tiles"
    # Groups of 24 cut the tiles' 16-column slices: dequantize.
    assert w4a16._choose_path(rows(1), packed(24)) == "dequant"
    assert w4a16._choose_path(rows(5), packed(24)) == "dequant"
    # One group of 96 columns holds its one (padded) tile.
    assert w4a16._choose_path(rows(1, 96), packed(96, 96)) == "gemv"
    with pytest.raises(ValueError, match="groups"):
        w4a16.matmul(rows(1), packed(32), path="gemv")
    with pytest.raises(ValueError, match="groups"):
        w4a16.matmul(rows(3), packed(24), path="tiles")
    with pytest.raises(ValueError, match="rows"):
        w4a16.matmul(rows(2), g128, path="gemv")


def test_path_falls_back_to_triton_without_nvcc(monkeypatch, tmp_path):
    """Where the CUDA C++ kernel would take the rows but does not build (no nvcc), the Triton
    paths do; where it builds, it is chosen (its shape rules: tests/.../test_w4a16_mma.py)."""
    from pagedserve.platforms.cuda.kernels import w4a16_mma

    weight = random_weight(64, 256, 128, seed=1)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, torch.device("cpu"))
    x = torch.ones(2, 256, device=DEVICE)
    monkeypatch.setattr(w4a16_mma, "eligible", lambda x, w: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    library = w4a16_mma.library
    library.cache_clear()
    try:
        assert w4a16._choose_path(x, packed) == "tiles"
    finally:
        library.cache_clear()  # the missing build is not remembered past this test
    monkeypatch.setattr(w4a16_mma, "library", lambda capability: object())
    assert w4a16._choose_path(x, packed) == "mma"


# Every group size the tiles take (16-column slices: per slice, 2 or 4 slices a group, a whole
# tile, several tiles, one group of all columns, and 48/80, which cut tiles unevenly), both
# dequantization forms, odd M and a K (300) that ends mid-tile and mid-slice, with and without
# split K.
@pytest.mark.parametrize("group", [16, 32, 48, 64, 80, 128, 256, 300])
@pytest.mark.parametrize("style", ["awq", "gguf"])
def test_tiles_every_group_size(group, style):
    weight = random_weight(40, 300, group, seed=group, style=style)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, group, DEVICE)
    for m, split_k in ((1, 3), (3, None), (19, 1)):
        x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m)).to(DEVICE,
                                                                              torch.float16)
        ref = reference(x, weight)
        out = torch.full((m, 40), float("nan"), dtype=x.dtype, device=DEVICE)
        w4a16.matmul(x, packed, split_k, out, path="tiles")
        assert not packed.counters.any()
        assert_close(out, ref, x.dtype)


# The tiles' variants (config fields: biased codes or q - z, the scale row a tile ahead or not,
# the tile computed transposed, the scales applied to the decoded weights) over the group sizes
# they take (32, 64: several groups a tile; 128; one group of all 300 columns), zero points and
# offsets, odd M (17; 65 over several blocks of rows for the transposed tiles), split K and not.
TILE_VARIANTS = [(bias, prefetch, False, False) for bias in (True, False)
                 for prefetch in (False, True)]
TILE_VARIANTS += [(True, False, True, False), (False, True, True, False),
                  (False, False, True, True), (False, True, True, True),
                  (False, True, False, True)]


@pytest.mark.parametrize("variant", TILE_VARIANTS,
                         ids=lambda v: "bias{}-prefetch{}-swap{}-scale{}".format(*map(int, v)))
@pytest.mark.parametrize("group", [32, 64, 128, 300])
def test_tile_variants_match_reference(variant, group, monkeypatch):
    bias, prefetch, swap_ab, scale_a = variant
    cfg = w4a16._TileConfig(16, 64, 4, 2, 2, bias, prefetch, swap_ab, scale_a)
    monkeypatch.setattr(w4a16, "_TILE_CONFIGS", ((None, cfg),))
    cases = [("awq", (3, 2)), ("gguf", (1, None)), ("awq", (17, None))]
    if swap_ab:  # the transposed store of several blocks of rows
        cases.append(("gguf", (65, None)))
    for style, (m, split_k) in cases:
        weight = random_weight(40, 300, group, seed=group + m, style=style)
        packed = w4a16.pack(weight.values, weight.scales, weight.offsets, group, DEVICE)
        x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m)).to(DEVICE,
                                                                              torch.float16)
        out = torch.full((m, 40), float("nan"), dtype=x.dtype, device=DEVICE)
        w4a16.matmul(x, packed, split_k, out, path="tiles")
        assert not packed.counters.any()
        assert_close(out, reference(x, weight), x.dtype)


@pytest.mark.parametrize("scale_a", [False, True])
@pytest.mark.parametrize("style", ["awq", "gguf"])
def test_swapped_tiles_in_float32(style, scale_a, monkeypatch):
    """The transposed tile with float32 activations (the ieee dot and 2**23 decode), K ending
    mid-tile, split K."""
    cfg = w4a16._TileConfig(16, 64, 4, 2, 2, False, False, True, scale_a)
    monkeypatch.setattr(w4a16, "_TILE_CONFIGS", ((None, cfg),))
    weight = random_weight(40, 200, 32, seed=9, style=style)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 32, DEVICE)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for split_k in (None, 2):
        out = torch.full((5, 40), float("nan"), device=DEVICE)
        w4a16.matmul(x, packed, split_k, out, path="tiles")
        assert not packed.counters.any()
        assert_close(out, reference(x, weight), x.dtype)


def test_amd_takes_the_tiles_before_the_transposed_form(monkeypatch):
    """The transposed tiles are for Hopper's wgmma: on AMD the tiles of the rows before them
    run in their place (the configurations scripts/amd_compile_sweep.py compiles)."""
    swapped = w4a16._TileConfig(128, 256, 8, 3, 2, False, True, True, True, True)
    monkeypatch.setattr(w4a16, "_TILE_CONFIGS", ((64, swapped._replace(block_m=64)),
                                                 (None, swapped)))
    assert w4a16._config_for(200, torch.bfloat16, None) == swapped
    assert w4a16._config_for(200, torch.bfloat16, "gfx950") == w4a16._TileConfig(
        128, 128, 8, 3, 2, False, True)
    assert w4a16._config_for(200, torch.bfloat16, "gfx942") == w4a16._TileConfig(
        128, 128, 8, 2, 2, False, True)
    assert w4a16._config_for(64, torch.float32, "gfx90a") == w4a16._TileConfig(
        64, 128, 4, 2, 2, False, True)


@pytest.fixture
def emulated_inline_asm(monkeypatch):
    """Inline PTX run by ``ptx_emulator`` under Triton's interpreter (which cannot run it)."""
    if HAS_NVIDIA:
        pytest.skip("the interpreter's stand-in; on a GPU the PTX runs itself")
    from triton.runtime import interpreter

    from tests.platforms.cuda import ptx_emulator

    class Results:
        def __init__(self, handles):
            self.handles = handles

        def get_result(self, i):
            return self.handles[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        if pack == 1:
            outs = ptx_emulator.run(asm, len(types), [v.data for v in values])
            return Results([interpreter.TensorHandle(o, t.scalar) for o, t in zip(outs, types)])
        # Two 32-bit elements in, two 16-bit ones out in one register (``_slice_ptx``).
        assert pack == 2 and len(values) == len(types) == 1, (pack, len(values), len(types))
        words = values[0].data
        flat = words.reshape(-1)
        (out,) = ptx_emulator.run(asm, 1, [flat[0::2], flat[1::2]])
        bits = out.view(np.uint32)
        halves = np.stack([bits & 0xFFFF, bits >> 16], axis=-1).astype(np.uint16)
        return Results([interpreter.TensorHandle(halves.reshape(words.shape).view(np.float16),
                                                 types[0].scalar)])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)


# (M, N, K, group, style): one and two rows, zero points and offsets, blocks of N and K that
# are whole (EVEN) or not (N = 72, K = 160 ends mid-tile), one group of all columns.
GEMV_PAIR_CASES = [(1, 256, 256, 128, "awq"), (2, 256, 384, 128, "gguf"),
                   (1, 72, 160, 160, "gguf"), (2, 72, 160, 160, "awq")]


@pytest.mark.parametrize("pair_words", [False, True])
@pytest.mark.parametrize("case", GEMV_PAIR_CASES, ids=lambda c: "m{}n{}k{}g{}-{}".format(*c))
def test_gemv_pairs_match_reference(case, pair_words, emulated_inline_asm, monkeypatch):
    """The packed-PTX GEMV (NVIDIA, bfloat16) with one word's pairs and with two words', its
    PTX emulated: x goes in as the bits of bfloat16 (the interpreter has no bfloat16; the
    kernel reads x only as 16- and 32-bit integers) and the output as float32."""
    m, n, k, group, style = case
    monkeypatch.setattr(w4a16, "_gemv_decode", lambda x: "pairs")
    monkeypatch.setattr(w4a16, "_gemv_config",
                        lambda: w4a16._GemvConfig(128, 64, 2, 8, 1 if pair_words else 3))
    weight = random_weight(n, k, group, seed=n + k, style=style)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, group, DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    for split_k in (None, 2):
        out = torch.full((m, n), float("nan"))
        w4a16._gemv(x.view(torch.int16), packed, split_k, out)
        assert not packed.counters.any()
        assert_close(out, reference(x, weight), torch.bfloat16)


def test_gemv_pairs_word_rows_from_its_row_count(monkeypatch):
    """``pair_words_from`` 2: one row reads each word's pairs, two rows pair word rows (which
    the H200 and H100 sweeps timed faster at each)."""
    launched = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["PAIR_WORDS"])

    monkeypatch.setattr(w4a16, "_w4a16_gemv_kernel", Spy())
    monkeypatch.setattr(w4a16, "_gemv_decode", lambda x: "pairs")
    monkeypatch.setattr(w4a16, "_gemv_config", lambda: w4a16._GemvConfig(128, 64, 2, 8, 2))
    weight = random_weight(128, 256, 128, seed=3, style="awq")
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, DEVICE)
    for m in (1, 2):
        w4a16._gemv(torch.zeros(m, 256), packed, None, torch.empty(m, 128))
    assert launched == [False, True]


@pytest.mark.parametrize("variant", [(False, False), (True, False), (True, True)],
                         ids=lambda v: "swap{}-scale{}".format(*map(int, v)))
@pytest.mark.parametrize("group", [32, 128, 300])
def test_tiles_ptx_decode_match_reference(variant, group, emulated_inline_asm, monkeypatch):
    """The tiles with their codes decoded by ``_slice_ptx`` (NVIDIA, 16-bit x), its PTX
    emulated, float16 activations."""
    swap_ab, scale_a = variant
    cfg = w4a16._TileConfig(16, 64, 4, 2, 2, False, True, swap_ab, scale_a, True)
    monkeypatch.setattr(w4a16, "_TILE_CONFIGS", ((None, cfg),))
    monkeypatch.setattr(w4a16, "_tile_ptx", lambda x: True)
    for style, (m, split_k) in (("awq", (3, 2)), ("gguf", (17, None))):
        weight = random_weight(40, 300, group, seed=group + m, style=style)
        packed = w4a16.pack(weight.values, weight.scales, weight.offsets, group, DEVICE)
        x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m)).half()
        out = torch.full((m, 40), float("nan"), dtype=x.dtype)
        w4a16.matmul(x, packed, split_k, out, path="tiles")
        assert not packed.counters.any()
        assert_close(out, reference(x, weight), x.dtype)


def test_slice_ptx_emulated_against_nibbles():
    """``_slice_ptx`` alone: each half of its output is one word's code at the slice's bits
    under the bias, whichever two words come in."""
    from tests.platforms.cuda import ptx_emulator

    gen = torch.Generator().manual_seed(4)
    words = torch.randint(-2**31, 2**31, (2, 256), generator=gen, dtype=torch.int64)
    for bias in (0x4300, 0x6400):
        for t in range(8):
            (got,) = ptx_emulator.run(w4a16._slice_ptx(t, bias * 0x10001), 1,
                                      [w.int().numpy() for w in words])
            bits = torch.from_numpy(got.view(np.uint32).astype(np.int64))
            for half, w in zip((bits & 0xFFFF, bits >> 16), words):
                assert torch.equal(half, ((w >> w4a16.nibble_shift(t)) & 0xF) | bias), (bias, t)


def test_pairs_ptx_emulated_against_float64():
    """``_pairs_ptx`` alone, through the emulator: random words, zero points and x pairs."""
    from tests.platforms.cuda import ptx_emulator

    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2):
        for words in (1, 2):
            n = 64
            w = torch.randint(-2**31, 2**31, (words, n), generator=gen, dtype=torch.int64)
            z = torch.randint(0, 16, (n,), generator=gen)
            x = torch.randn(rows, words, 8, n, generator=gen).bfloat16()
            zb = (z + 128).bfloat16().view(torch.int16).int() & 0xFFFF
            xs = x.view(torch.int16).int() & 0xFFFF  # [rows, words, 8 halves, n]
            pairs = xs[:, :, 0::2] | (xs[:, :, 1::2] << 16)  # [rows, words, 4, n]
            inputs = [wi.int().numpy() for wi in w] + [(zb | zb << 16).numpy()]
            inputs += [pairs[r].reshape(4 * words, n)[i].numpy() for r in range(rows)
                       for i in range(4 * words)]
            got = ptx_emulator.run(w4a16._pairs_ptx(rows, words), rows, inputs)
            codes = [[(w[i] >> w4a16.nibble_shift(t)) & 0xF for t in range(8)]
                     for i in range(words)]
            for r in range(rows):
                want = torch.zeros(n, dtype=torch.float64)
                for i in range(4 * words):  # pair i of x meets these codes
                    if words == 1:
                        lo, hi = codes[0][2 * i], codes[0][2 * i + 1]
                    else:  # x pair t: slice t of both words
                        lo, hi = codes[0][i], codes[1][i]
                    xl, xh = x[r].reshape(4 * words, 2, n)[i].double()
                    want += (lo - z) * xl + (hi - z) * xh
                err = (torch.from_numpy(got[r]).double() - want).abs().max().item()
                assert err <= 2e-2 * want.abs().max().item(), (rows, words, err)


def test_pack_keeps_zero_points_exact_in_float16():
    weight = random_weight(8, 64, 32, seed=1)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 32, torch.device("cpu"))
    assert packed.scales.dtype == torch.float16 and packed.zero_point
    assert torch.equal(packed.shifts.float(), packed.shifts.float().round())
    # 64 columns pad to one tile of 128: 16 words of 8 codes.
    assert packed.qweight.shape == (16, 8) and packed.qweight.dtype == torch.int32
    # Word r holds columns r + 16 t (slice t) at nibble_shift(t): slices 2p and 2p + 1 at bits
    # 4p and 16 + 4p.
    bits = [0, 16, 4, 20, 8, 24, 12, 28]
    assert [w4a16.nibble_shift(t) for t in range(8)] == bits
    for r in (0, 5):
        word = packed.qweight[r, 0].item() & 0xFFFFFFFF
        codes = [(word >> b) & 0xF for b in bits]
        expected = [weight.values[0, r + 16 * t].item() if r + 16 * t < 64 else 0
                    for t in range(8)]
        assert codes == expected


def test_pack_keeps_gguf_offsets_in_float16():
    weight = random_weight(8, 64, 32, seed=1, style="gguf")
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 32, torch.device("cpu"))
    assert packed.scales.dtype == torch.float16 and not packed.zero_point


def test_dummy_weights_pack_like_awq():
    """``--load-format dummy --quantization awq``'s weights: float16 scales and integer zero
    points, so benchmarks read the bytes a real AWQ checkpoint's layer would."""
    dense = torch.randn(16, 256, generator=torch.Generator().manual_seed(7)) * 0.02
    weight = GroupQuantWeight.quantize(dense, bits=4, group_size=128)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, torch.device("cpu"))
    assert packed.scales.dtype == torch.float16 and packed.zero_point


@pytest.mark.parametrize("half_exact", [True, False])
def test_pack_falls_back_to_offsets_for_zero_scales(half_exact):
    weight = random_weight(4, 32, 32, seed=2)
    if not half_exact:
        weight.scales = weight.scales * (1 + 1e-6)
    weight.scales[0, 0] = 0.0
    weight.offsets[0, 0] = 0.25
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 32, DEVICE)
    assert not packed.zero_point  # (0 - z) * 0 cannot give the offset
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert_close(w4a16.matmul(x, packed), reference(x, weight), torch.float32)


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_method_with_act_order(act_order):
    weight = random_weight(48, 160, 32, seed=3, act_order=act_order)
    layer = nn.Module()
    method = quant_linear.W4A16LinearMethod()
    method.create_weights(layer, weight, torch.float32, DEVICE)
    assert all(not p.requires_grad for p in layer.parameters())
    x = torch.randn(2, 3, 160, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = method.apply(layer, x)
    assert out.shape == (2, 3, 48) and out.dtype == torch.float32
    assert_close(out.reshape(6, 48), reference(x.reshape(6, 160), weight), torch.float32)


def test_platform_routes_4bit_only():
    from pagedserve.platforms.cuda.platform import CudaPlatform
    from pagedserve.quant.linear_method import DenseLinearMethod

    four = random_weight(8, 64, 32, seed=5)
    eight = GroupQuantWeight(four.values, four.scales, four.offsets, 8, 32)
    assert isinstance(CudaPlatform.linear_method(four), quant_linear.W4A16LinearMethod)
    assert isinstance(CudaPlatform.linear_method(eight), DenseLinearMethod)
    assert isinstance(CudaPlatform.linear_method(torch.zeros(8, 64)), DenseLinearMethod)


# Llama-3-8B: (N, K) of fused qkv, o, gate/up and down.
_llama_weights: dict[tuple[int, int], GroupQuantWeight] = {}


def _llama_weight(n: int, k: int) -> GroupQuantWeight:
    if (n, k) not in _llama_weights:
        _llama_weights.clear()  # one shape at a time: the tests run grouped by shape
        _llama_weights[n, k] = random_weight(n, k, 128, seed=n + k, style="awq")
    return _llama_weights[n, k]


LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype_m", [(torch.bfloat16, m) for m in (1, 2, 7, 16, 33, 64, 129, 256)]
                         + [(torch.float16, m) for m in (1, 7, 64, 300)],
                         ids=lambda d: f"{str(d[0])[6:]}-m{d[1]}")
@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"n{s[0]}k{s[1]}")
def test_kernel_llama_sizes_cuda(shape, dtype_m):
    dtype, m = dtype_m
    n, k = shape
    weight = _llama_weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    ref = reference(x, weight)
    assert_close(run_kernel(x, weight), ref, dtype)
    # The CUDA C++ kernels at every M (wgmma on sm_90); up to 16 rows the Triton tiles and
    # GEMV as well.
    paths = (["mma"] + ["wgmma"] * (torch.cuda.get_device_capability() == (9, 0))
             + ["tiles"] * (m <= 16) + ["gemv"] * (m <= w4a16.GEMV_MAX_M))
    for path in paths:
        assert_close(run_kernel(x, weight, path=path), ref, dtype)


# The tiles the large-M sweep times (scripts/bench_w4a16.py), whichever it chooses: transposed
# (the decoded weights as wgmma's register operand) with two accumulators or the scales on the
# weights, codes by _slice_ptx or not, at the 8B down projection (K = 14,336) with rows in one
# block and in several. (BLOCK_M, BLOCK_N, warps, stages, prefetch, swap_ab, scale_a, ptx)
LARGE_CUDA_CONFIGS = [(64, 128, 4, 3, True, False, False, True),
                      (64, 128, 4, 3, True, True, False, False),
                      (64, 128, 4, 3, True, True, False, True),
                      (64, 128, 4, 3, True, True, True, False),
                      (64, 256, 8, 3, True, True, True, True),
                      (128, 128, 4, 3, True, True, True, True),
                      (128, 256, 8, 3, True, True, True, False),
                      (128, 256, 8, 3, True, True, True, True),
                      (128, 128, 8, 3, False, False, False, True)]


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype_m", [(torch.bfloat16, m) for m in (65, 129, 256)]
                         + [(torch.float16, 100)], ids=lambda d: f"{str(d[0])[6:]}-m{d[1]}")
@pytest.mark.parametrize(
    "cfg", LARGE_CUDA_CONFIGS,
    ids=lambda c: "{}x{}-{}w-{}st-pre{:d}-swap{:d}-scale{:d}-ptx{:d}".format(*c))
def test_large_tiles_llama_cuda(cfg, dtype_m, monkeypatch):
    dtype, m = dtype_m
    block_m, block_n, warps, stages, prefetch, swap_ab, scale_a, ptx = cfg
    tile = w4a16._TileConfig(block_m, block_n, warps, stages, 2, False, prefetch, swap_ab,
                             scale_a, ptx)
    monkeypatch.setattr(w4a16, "_TILE_CONFIGS", ((None, tile),))
    weight = _llama_weight(4096, 14336)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, DEVICE)
    x = torch.randn(m, 14336, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = torch.full((m, 4096), float("nan"), dtype=dtype, device=DEVICE)
    w4a16.matmul(x, packed, out=out, path="tiles")
    assert not packed.counters.any()
    assert_close(out, reference(x, weight), dtype)


@cuda
@needs_cuda
@pytest.mark.parametrize("style", ["gguf", "awq"])
@pytest.mark.parametrize("group", [32, 64, 128, 4096])
def test_group_sizes_cuda(group, style):
    weight = random_weight(1024, 4096, group, seed=group, style=style, act_order=True)
    layer = nn.Module()
    method = quant_linear.W4A16LinearMethod()
    method.create_weights(layer, weight, torch.bfloat16, DEVICE)
    for m in (1, 2, 5, 64, 257):
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        assert_close(method.apply(layer, x), reference(x, weight), torch.bfloat16)


@cuda
@needs_cuda
def test_graph_capture_cuda():
    weight = random_weight(4096, 4096, 128, seed=6)
    packed = w4a16.pack(weight.values, weight.scales, weight.offsets, 128, DEVICE)
    x = torch.randn(4, 4096, device=DEVICE, dtype=torch.bfloat16)
    w4a16.matmul(x, packed)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16.matmul(x, packed)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(x, weight), torch.bfloat16)


@pytest.mark.parametrize("config", [
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True,
     "checkpoint_format": "gptq"},
    {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
], ids=["gptq-act-order", "awq"])
def test_engine_matches_transformers(config, tiny_model_folder, tmp_path, monkeypatch):
    """A tiny model whose 4-bit layers run the kernel (here on the CPU platform, under the
    interpreter without a GPU) against transformers on the dequantized weights."""
    from pagedserve import LLM
    from pagedserve.platforms.cpu.platform import CpuPlatform
    from pagedserve.platforms.cuda.platform import CudaPlatform
    from tests.quant.packers import PROMPT_LENS, linear_methods, write_quantized_pair
    from tests.tiny_models import assert_greedy_matches, hf_model, random_prompts

    monkeypatch.setattr(CpuPlatform, "linear_method",
                        classmethod(lambda cls, w, nums: CudaPlatform.linear_method(w, nums)))
    quantized, reference_dir = tmp_path / "q", tmp_path / "float"
    write_quantized_pair(tiny_model_folder("llama3"), quantized, reference_dir, config)
    llm = LLM(model=str(quantized), device=DEVICE.type, dtype="float32",
              kv_cache_memory_bytes=64 << 20)
    assert "W4A16LinearMethod" in set(linear_methods(llm).values())
    prompts = random_prompts(config["quant_method"], PROMPT_LENS)
    assert assert_greedy_matches(llm, hf_model(reference_dir), prompts) >= 1


# Compiles every configuration the launches use for an H100/H200 (sm_90) with Triton's bundled
# toolchain, no GPU needed (scripts/w4a16_sass.py --check): catches what only the real compiler
# rejects. Run in its own process, away from the interpreter this module switches on.
@pytest.mark.slow
def test_compiles_for_sm90():
    run_check("w4a16_sass.py")
