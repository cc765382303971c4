"""``--kv-cache-dtype bfloat16`` on the CPU: the decode kernel rounds the step's keys and values
into the pool bit for bit as torch does, attends over them to float32 rounding, and does so in
builds for narrower instruction sets; an engine with the bf16 pool holds twice the blocks and
keeps the float32 pool's greedy tokens, and its cached and chunked prompts match whole ones.

The attention kernel's float32 and bfloat16 numerics over every layout (block sizes, GQA, odd
head dims, verify steps) are in ``test_layer_ops.py``."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.platforms.cpu import layer_ops, native_build
from pagedserve.platforms.cpu.attention import CpuPagedAttention
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.interface import Platform
from tests.platforms.cpu.native_variants import build_variant
from tests.platforms.cpu.paged_cases import decode_case, dense_reference
from tests.tiny_models import make_llm, random_tokens

BF16 = torch.bfloat16
# The largest gap between the bf16 and float32 pools' logprobs of the same greedy token on the
# tiny model: 3.7e-3 over these prompts, 2.5e-3 to 3.5e-3 over three other seeds' prompts.
LOGPROB_TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def built():
    if not layer_ops.available():
        pytest.skip("no working C compiler for the native kernels (see the log)")


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, subnormals among them), halfway cases of the
    rounding, the overflow to infinity and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130 * (1 + 2**-8),
                         3.3961e38, -3.3961e38, 1e-40, -1e-45, 0.0, -0.0, float("inf")])
    x[:ties.numel()] = ties
    return x


def write_and_attend(dim: int, kv_heads: int, heads: int, seed: int, k=None, v=None):
    """One decode step of sequences of 1 to 70 tokens into a bf16 pool: (output, reference,
    the pool's rows at the step's slots, the step's k and v)."""
    seq_lens = [1 + (7 * i) % 70 for i in range(12)]
    cache, keys, values, meta = decode_case(4, heads, kv_heads, dim, seq_lens, seed, BF16)
    num = len(seq_lens)
    k = torch.stack([kk[-1] for kk in keys]) if k is None else k.view(num, kv_heads, dim)
    v = torch.stack([vv[-1] for vv in values]) if v is None else v.view(num, kv_heads, dim)
    for i in range(num):
        keys[i][-1], values[i][-1] = k[i], v[i]
    q = torch.randn(num, heads, dim) * 2
    out = CpuPagedAttention(heads, dim, kv_heads, dim ** -0.5).forward(q, k, v, cache, meta)
    expected = dense_reference(q, keys, values, dim ** -0.5, heads // kv_heads, BF16)
    flat = cache.view(2, -1, kv_heads, dim)
    return out, expected, flat[:, meta.slot_mapping], k, v


def assert_rounded_as_torch(written: torch.Tensor, x: torch.Tensor) -> None:
    expected = x.to(BF16)
    nan = expected.isnan()
    assert torch.equal(written.isnan(), nan)  # NaN stays NaN (torch writes 0xffff)
    assert torch.equal(written.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def check_kernel(dim: int = 20, kv_heads: int = 2, heads: int = 6) -> None:
    """Writes round bit for bit as torch does, over every kind of float; attention over random
    keys equals float64 attention over the keys as rounded, to float32 rounding."""
    n = 12 * kv_heads * dim
    k, v = special_floats(n, 1), special_floats(n, 2)
    _, _, rows, k, v = write_and_attend(dim, kv_heads, heads, 0, k, v)
    assert_rounded_as_torch(rows[0], k)
    assert_rounded_as_torch(rows[1], v)
    out, expected, rows, k, v = write_and_attend(dim, kv_heads, heads, 3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(rows[0], k.to(BF16)) and torch.equal(rows[1], v.to(BF16))


@pytest.mark.parametrize("dim,kv_heads,heads", [(64, 2, 8), (128, 1, 4), (20, 2, 6),
                                                (8, 3, 9)])
def test_kernel_rounds_as_torch_and_attends_in_float32(poisoned, dim, kv_heads, heads):
    check_kernel(dim, kv_heads, heads)


def put_in_place(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_ops, "library", lambda: layer_ops.declare(lib))


def test_check_catches_truncating_writes(tmp_path, monkeypatch):
    # Dropping the low half instead of rounding: within one bf16 ulp, not torch's value.
    lib = build_variant(layer_ops.SOURCE, tmp_path, monkeypatch, {
        "(uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)": "(uint16_t)(bits >> 16)"})
    put_in_place(lib, monkeypatch)
    with pytest.raises(AssertionError):
        check_kernel()


@pytest.mark.parametrize("flags,identical", [
    (("-mno-avx512bf16",), True),  # the kernel uses no AVX512-BF16: the same code
    (("-mno-avx512f",), False),  # AVX2 only, as CI's CPU: other reduction widths
    (("-mno-avx2",), False),  # the portable loops
], ids=["no-avx512bf16", "avx2", "portable"])
def test_narrower_builds(tmp_path, monkeypatch, poisoned, flags, identical):
    if "avx512_bf16" not in native_build._cpu_flags().split():
        pytest.skip("a CPU with AVX512-BF16 builds these variants")
    shapes = [(64, 2, 8), (20, 2, 6)]
    shipped = [write_and_attend(*shape, seed=5)[:3] for shape in shapes]
    put_in_place(build_variant(layer_ops.SOURCE, tmp_path, monkeypatch, {}, flags), monkeypatch)
    check_kernel()
    for shape, (out, _, rows) in zip(shapes, shipped):
        got, _, got_rows, _, _ = write_and_attend(*shape, seed=5)
        assert torch.equal(got_rows, rows)
        if identical:
            assert torch.equal(got, out)


def test_platforms_that_cannot_hold_bf16_refuse_it():
    class Other(Platform):
        name = "other"

    assert CpuPlatform.kv_cache_torch_dtype("bfloat16", torch.float32) == BF16
    assert Other.kv_cache_torch_dtype("bfloat16", BF16) == BF16  # the model's dtype anyway
    with pytest.raises(ConfigError, match="--kv-cache-dtype bfloat16 is not supported on the "
                                          "other platform"):
        Other.kv_cache_torch_dtype("bfloat16", torch.float32)


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


def greedy(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


def test_engine_keeps_the_float32_pools_greedy_tokens(llama3_folder):
    rng = random.Random(31)
    prompts = [random_tokens(rng, n) for n in (5, 40, 130, 300)]
    f32 = make_llm(llama3_folder)
    bf16 = make_llm(llama3_folder, kv_cache_dtype="bfloat16")
    assert bf16.engine.kv.num_blocks == 2 * f32.engine.kv.num_blocks
    (tokens, logprobs), (ref_tokens, ref_logprobs) = greedy(bf16, prompts), greedy(f32, prompts)
    assert tokens == ref_tokens
    gap = max(abs(a - b) for got, ref in zip(logprobs, ref_logprobs) for a, b in zip(got, ref))
    assert gap <= LOGPROB_TOL


def test_cached_and_chunked_prompts_match_whole_ones(llama3_folder):
    """The prompt's first part from the prefix cache, or computed in chunks, reads the pool's
    rounded keys; a whole prompt attends over its keys rounded the same way. A cached prefix
    changes no number; chunks change the shapes of the attention calls (and their steps run
    decodes in torch's attention, not the kernel), which moves logprobs by float32 rounding,
    as with a float32 pool (1e-6 here with either)."""
    rng = random.Random(32)
    prefix = random_tokens(rng, 100)
    prompts = [prefix + random_tokens(rng, n) for n in (7, 30)]
    whole = make_llm(llama3_folder, kv_cache_dtype="bfloat16", enable_prefix_caching=False,
                     enable_chunked_prefill=False, max_model_len=256,
                     max_num_batched_tokens=256)
    cached = make_llm(llama3_folder, kv_cache_dtype="bfloat16")
    chunked = make_llm(llama3_folder, kv_cache_dtype="bfloat16", enable_prefix_caching=False,
                       max_num_batched_tokens=32)
    expected = greedy(whole, prompts)
    cached.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)
    assert greedy(cached, prompts) == expected
    assert cached.engine.stats().prefix_hit_tokens >= 2 * 96
    tokens, logprobs = greedy(chunked, prompts)
    assert tokens == expected[0]
    for got, ref in zip(logprobs, expected[1]):
        assert got == pytest.approx(ref, abs=1e-5)
