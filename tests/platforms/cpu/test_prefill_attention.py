"""The blocked CPU prefill attention kernel (``lo_paged_prefill``) against float64 causal
attention over a NaN-poisoned paged pool of float32 or bfloat16: prompt chunks of 1 to 599
rows after cached prefixes of 0 to 300 tokens, several sequences a call, GQA ratios 1, 3 and
4, head dims 64 and 128 (and 20, which takes the plain loops), every thread count. Output
buffers start as NaN (the ``poisoned`` fixture) and so does every slot the step must not
read, so an unwritten row or a read past the causal edge shows as non-finite.

Tolerance: 2e-5 absolute and relative against float64, as the decode kernel's: both
accumulate in float32 with the same exp approximation (a few ulps)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttention
from pagedserve.platforms.cpu import layer_ops
from pagedserve.platforms.cpu.attention import CpuPagedAttention
from tests.platforms.cpu.native_variants import build_variant
from tests.platforms.cpu.paged_cases import causal_reference, prefill_case

KV_DTYPES = [torch.float32, torch.bfloat16]
TOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    if not layer_ops.available():
        pytest.skip("no working C compiler for the native kernels (see the log)")


@pytest.fixture
def native_only(monkeypatch):
    """Fails any step that falls back to the torch ops."""
    monkeypatch.setattr(TorchPagedAttention, "forward", None)


def attend(heads, kv_heads, dim, contexts, news, kv_dtype, block_size=16, seed=0, window=None,
           softcap=None):
    """(the kernel's output, the float64 reference, the pool's rows at the step's slots, the
    step's k and v)."""
    cache, q, k, v, meta, keys, values = prefill_case(block_size, heads, kv_heads, dim,
                                                      contexts, news, seed, kv_dtype)
    attention = CpuPagedAttention(heads, dim, kv_heads, dim ** -0.5)
    out = attention.forward(q, k, v, cache, meta, window, softcap)
    assert [name for name, _ in attention._plan.calls] == ["lo_paged_prefill"]
    expected = causal_reference(q, keys, values, contexts, dim ** -0.5, heads // kv_heads,
                                kv_dtype, window, softcap)
    written = cache.view(2, -1, kv_heads, dim)[:, meta.slot_mapping]
    return out, expected, written, k, v


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    torch.testing.assert_close(actual.double(), expected, atol=TOL, rtol=TOL)


def check_prefill(dims=(64, 20)) -> None:
    """Both cache dtypes, GQA 3, prefixes 0 / 17 / 300, and a window of 40 with scores capped
    at 3: the kernel within TOL of float64."""
    for kv_dtype in KV_DTYPES:
        for dim, window, softcap in [(dim, None, None) for dim in dims] + [(dims[0], 40, 3.0)]:
            out, expected, _, _, _ = attend(9, 3, dim, [0, 17, 300], [45, 1, 33], kv_dtype,
                                            window=window, softcap=softcap)
            close(out, expected)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA 1, 3, 4
def test_prefill_matches_float64_reference(poisoned, native_only, heads, kv_heads, dim,
                                           kv_dtype):
    contexts, news = [0, 1, 15, 16, 17, 300], [599, 1, 33, 47, 17, 101]
    out, expected, written, k, v = attend(heads, kv_heads, dim, contexts, news, kv_dtype,
                                          seed=dim + heads)
    close(out, expected)
    # The step's rows are rounded into the pool as torch rounds them.
    assert torch.equal(written[0], k.to(kv_dtype)) and torch.equal(written[1], v.to(kv_dtype))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_chunks_across_tile_edges(poisoned, native_only, monkeypatch, block_size, threads):
    """Chunks and prefixes on either side of the 32-key tiles and of the 32-token query tiles
    (96 rows over GQA 3), with the head dim that takes the plain loops among them."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    contexts, news = [0, 3, 31, 32, 33, 100, 0, 64], [32, 33, 1, 31, 64, 65, 97, 2]
    for dim in (64, 20):
        out, expected, _, _, _ = attend(9, 3, dim, contexts, news, torch.float32, block_size,
                                        seed=block_size)
        close(out, expected)


@pytest.mark.parametrize("window,softcap", [(7, None), (45, 20.0), (None, 3.0)], ids=str)
def test_window_and_softcap_in_both_kernels(poisoned, native_only, window, softcap):
    """Windows shorter than a key tile and across several, and caps that bend the scores:
    prompt chunks past the window (one starting mid-window after its cached prefix) through
    ``lo_paged_prefill``, decode rows and a verify chunk through ``lo_paged_decode``, over
    blocks of 5 (windows start mid-block)."""
    contexts, news = [0, 40, 100, 33, 17, 64], [70, 1, 65, 3, 1, 2]
    cache, q, k, v, meta, keys, values = prefill_case(5, 9, 3, 64, contexts, news, 11)
    meta.decode_cpu = [False, True, False, True, True, False]
    attention = CpuPagedAttention(9, 64, 3, 0.125)
    out = attention.forward(q, k, v, cache, meta, window, softcap)
    assert [name for name, _ in attention._plan.calls] == ["lo_paged_prefill", "lo_paged_decode"]
    close(out, causal_reference(q, keys, values, contexts, 0.125, 3, window=window,
                                softcap=softcap))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_large_scores(native_only, kv_dtype):
    """Every query aligned with one key among random ones: scores far apart exercise the
    online softmax's rescaling across tiles."""
    cache, q, k, v, meta, keys, values = prefill_case(16, 2, 1, 64, [150], [70], 3, kv_dtype)
    q.copy_(keys[0][40, :, None].expand(70, 2, 64) * 6)
    out = CpuPagedAttention(2, 64, 1, 1.0).forward(q, k, v, cache, meta)
    close(out, causal_reference(q, keys, values, [150], 1.0, 2, kv_dtype))


@pytest.mark.parametrize("kv_dtype,window", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float32, 45)])
def test_a_prompt_gets_the_same_numbers_however_chunked(native_only, kv_dtype, window):
    """A 300-token prompt in one chunk, and as chunks of 100, 77 and 123 after their cached
    prefix: bit for bit the same output rows (with a window too, whose first tile then
    differs between a chunk's first and last rows)."""
    cache, q, k, v, meta, keys, values = prefill_case(16, 9, 3, 64, [0], [300], 7, kv_dtype)
    whole = CpuPagedAttention(9, 64, 3, 0.125).forward(q, k, v, cache.clone(), meta, window)
    start = 0
    for n in (100, 77, 123):
        part, pq, pk, pv, pmeta, _, _ = prefill_case(16, 9, 3, 64, [start], [n], 7, kv_dtype)
        # The same keys and values as the whole prompt's, in this case's own blocks.
        flat = part.view(2, -1, 3, 64)
        table = pmeta.block_tables[0].long()
        slots = (table[torch.arange(start) // 16] * 16 + torch.arange(start) % 16)
        flat[0, slots], flat[1, slots] = k[:start].to(kv_dtype), v[:start].to(kv_dtype)
        rows = slice(start, start + n)
        out = CpuPagedAttention(9, 64, 3, 0.125).forward(q[rows], k[rows], v[rows], part, pmeta,
                                                         window)
        assert torch.equal(out, whole[rows])
        start += n


@pytest.mark.parametrize("edit", [
    # Off by one at the causal edge: each row also sees the key after it.
    {"int seen = p0 + r / group - j0 + 1;": "int seen = p0 + r / group - j0 + 2;"},
    # The last tile reads one key past the chunk (a poisoned slot).
    {"int M = tokens * group, kv_end = p0 + tokens;":
     "int M = tokens * group, kv_end = p0 + tokens + 1;"},
    # Off by one at the window's edge: each row sees one key more.
    {"p0 + r / group - window + 1 - j0 : 0;": "p0 + r / group - window - j0 : 0;"},
], ids=["causal-off-by-one", "reads-past-the-end", "window-off-by-one"])
def test_check_catches_a_broken_kernel(tmp_path, monkeypatch, edit):
    lib = build_variant(layer_ops.SOURCE, tmp_path, monkeypatch, edit)
    monkeypatch.setattr(layer_ops, "library", lambda: layer_ops.declare(lib))
    with pytest.raises(AssertionError):
        check_prefill()


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)],
                         ids=["avx2", "no-avx2"])
def test_narrower_builds(tmp_path, monkeypatch, poisoned, native_only, flags):
    """AVX2 without AVX-512 (CI's CPUs: 8-lane micro-kernels) and a build without AVX2."""
    lib = build_variant(layer_ops.SOURCE, tmp_path, monkeypatch, {}, flags)
    monkeypatch.setattr(layer_ops, "library", lambda: layer_ops.declare(lib))
    check_prefill(dims=(64, 128, 20))


def test_rows_of_no_sequence_take_the_torch_path():
    """Padded rows past the last sequence's (as a bucketing platform pads) would be left
    unwritten by the kernel, so such a step keeps the torch ops."""
    cache, q, k, v, meta, _, _ = prefill_case(16, 2, 1, 16, [3], [5], 1)
    meta.num_tokens += 1
    pad = torch.zeros(1, 2, 16)
    q, k, v = torch.cat([q, pad]), torch.cat([k, pad[:, :1]]), torch.cat([v, pad[:, :1]])
    meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping[-1:]])
    attention = CpuPagedAttention(2, 16, 1, 0.25)
    out = attention.forward(q, k, v, cache, meta)
    assert attention._plan is None and torch.isfinite(out[:5]).all()


def _alone(meta: AttentionMetadata, seqs: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """``meta`` cut down to sequences ``seqs`` (a step of them alone) and their rows."""
    starts = meta.query_start_loc.tolist()
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
    lens = [meta.query_lens_cpu[i] for i in seqs]
    picked = torch.tensor(seqs)
    sub = AttentionMetadata(
        num_seqs=len(seqs), num_tokens=len(rows), max_query_len=max(lens),
        max_seq_len=meta.max_seq_len, block_size=meta.block_size,
        query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
        seq_lens=meta.seq_lens[picked], context_lens=meta.context_lens[picked],
        block_tables=meta.block_tables[picked], slot_mapping=meta.slot_mapping[rows],
        query_lens_cpu=lens, seq_lens_cpu=[meta.seq_lens_cpu[i] for i in seqs],
        decode_cpu=[meta.decode_cpu[i] for i in seqs],
        decode_or_verify=all(meta.decode_cpu[i] for i in seqs))
    return sub, rows


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_rows_among_prompt_chunks_match_their_own_steps(kv_dtype, poisoned, native_only):
    """A step of decode rows, a verify chunk (a known token and two drafts) and prompt chunks
    (one of them a single row after a cached prefix): the decode and verify rows take
    ``lo_paged_decode`` and come out bit for bit as in a step of them alone, the prompt
    chunks take ``lo_paged_prefill`` and come out as in a step of prompt chunks alone, all
    within TOL of float64. So a stream's rows do not depend on what shares its step (int8
    activations would turn a last-place difference into a different token). Run through the
    prefill kernel, as decode rows among prompt chunks were, they differ."""
    heads, kv_heads, dim = 6, 2, 64
    contexts, news = [40, 0, 17, 300, 33, 25], [1, 23, 1, 5, 1, 3]
    decode = [True, False, True, False, False, True]
    cache, q, k, v, meta, keys, values = prefill_case(16, heads, kv_heads, dim, contexts, news,
                                                      7, kv_dtype)
    meta.decode_cpu = decode

    def attend(step_meta, rows):
        attention = CpuPagedAttention(heads, dim, kv_heads, dim ** -0.5)
        out = attention.forward(q[rows], k[rows], v[rows], cache.clone(), step_meta)
        return out, [name for name, _ in attention._plan.calls]

    everything = torch.arange(sum(news))
    mixed, kernels = attend(meta, everything)
    assert kernels == ["lo_paged_prefill", "lo_paged_decode"]
    close(mixed, causal_reference(q, keys, values, contexts, dim ** -0.5, heads // kv_heads,
                                  kv_dtype))
    for seqs, kernel in (([0, 2, 5], "lo_paged_decode"), ([1, 3, 4], "lo_paged_prefill")):
        alone, kernels = attend(*_alone(meta, seqs))
        assert kernels == [kernel]
        assert torch.equal(alone, mixed[_alone(meta, seqs)[1]])
    meta.decode_cpu = [False] * len(news)  # every row through the prefill kernel
    through_prefill, _ = attend(meta, everything)
    decode_rows = _alone(meta, [0, 2, 5])[1]
    assert not torch.equal(through_prefill[decode_rows], mixed[decode_rows])
