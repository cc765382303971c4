"""The native CPU layer ops and decode attention against float64 references: the plain-torch
``LayerOps`` for the elementwise ops, dense attention over a NaN-poisoned paged pool of float32
or bfloat16 (the reference then reads the keys and values rounded as the pool holds them)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.torch_paged import SHORT_QUERY, TorchPagedAttention
from pagedserve.models.layer_ops import LayerOps
from pagedserve.platforms.cpu import layer_ops
from pagedserve.platforms.cpu.attention import CpuPagedAttention
from pagedserve.platforms.cpu.layer_ops import CpuLayerOps
from pagedserve.platforms.cpu.platform import CpuPlatform
from tests.platforms.cpu.paged_cases import (
    causal_reference,
    decode_case,
    dense_reference,
    prefill_case,
)

KV_DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not layer_ops.available():
        pytest.skip("no working C compiler for the native kernels (see the log)")


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-5) -> None:
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 7, 129])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rows, with_residual):
    torch.manual_seed(rows)
    hidden = 576
    # x is a strided view, as a slice of a wider projection would be.
    x = torch.randn(rows, hidden + 8)[:, :hidden]
    weight = torch.rand(hidden) + 0.5
    residual = torch.randn(rows, hidden) if with_residual else None
    expected = LayerOps.rms_norm(x.double(), weight.double(), 1e-6,
                                 None if residual is None else residual.double())
    got = CpuLayerOps.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        close(got[0], expected[0])
        assert got[1] is residual  # the sum is written in place
        close(got[1], expected[1])
    else:
        close(got, expected)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_and_mul(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 1536) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 89.0])  # past exp's clamped range
    close(CpuLayerOps.silu_and_mul(x), LayerOps.silu_and_mul(x.double()))


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (2, 1, 16)])
def test_rotary(rows, heads, kv_heads, dim):
    torch.manual_seed(rows)
    max_pos = 300
    angles = torch.rand(max_pos, dim // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    # q and k are strided views of one fused projection, as in the model.
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    positions = torch.randint(0, max_pos, (rows,))
    positions[0] = max_pos - 1
    eq, ek = LayerOps.rotary(positions, q.double(), k.double(), cos.double(), sin.double())
    gq, gk = CpuLayerOps.rotary(positions, q, k, cos, sin)
    close(gq, eq)
    close(gk, ek)
    assert gq.data_ptr() == q.data_ptr()  # rotated in place


def test_ops_fall_back_for_other_dtypes():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    torch.testing.assert_close(CpuLayerOps.rms_norm(x, w, 1e-6), LayerOps.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(CpuLayerOps.silu_and_mul(x), LayerOps.silu_and_mul(x))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize("dim", [16, 64, 128, 20])  # 20: not a multiple of the vector width
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_attention_matches_dense_reference(block_size, heads, kv_heads, dim, kv_dtype):
    seq_lens = [1, 2, 33, 100, 17, 64]
    cache, keys, values, meta = decode_case(block_size, heads, kv_heads, dim, seq_lens,
                                            seed=block_size * dim + heads, dtype=kv_dtype)
    # q/k/v are strided views of a fused projection, as in the model.
    num = len(seq_lens)
    qkv = torch.randn(num, (heads + 2 * kv_heads) * dim) * 2
    q = qkv[:, :heads * dim].view(num, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(num, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(num, kv_heads, dim)
    for i, n in enumerate(seq_lens):
        k[i], v[i] = keys[i][n - 1], values[i][n - 1]
    scale = dim ** -0.5
    out = CpuPagedAttention(heads, dim, kv_heads, scale).forward(q, k, v, cache, meta)
    close(out, dense_reference(q, keys, values, scale, heads // kv_heads, kv_dtype))
    # The step's rows are rounded into the pool as torch rounds them.
    flat = cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat[0, meta.slot_mapping], k.to(kv_dtype))
    assert torch.equal(flat[1, meta.slot_mapping], v.to(kv_dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_attention_with_large_scores(kv_dtype):
    """Scores far apart (a key aligned with q among random ones) exercise the rescaling."""
    heads, kv_heads, dim = 2, 1, 64
    seq_lens = [70]
    cache, keys, values, meta = decode_case(4, heads, kv_heads, dim, seq_lens, seed=3,
                                            dtype=kv_dtype)
    q = keys[0][40, :, None].expand(1, heads, dim).contiguous() * 6
    k, v = keys[0][69:], values[0][69:]
    out = CpuPagedAttention(heads, dim, kv_heads, 1.0).forward(q, k, v, cache, meta)
    close(out, dense_reference(q, keys, values, 1.0, heads // kv_heads, kv_dtype))


@pytest.mark.parametrize("query_len,decode", [(1, False), (2, False), (SHORT_QUERY + 1, True)])
def test_prompt_chunks_and_long_queries_take_the_prefill_kernel(monkeypatch, query_len, decode):
    """A prompt chunk, however short (a one-row chunk too: its numbers must not depend on
    whether its prefix was cached), and a verify chunk longer than the decode kernel takes:
    ``lo_paged_prefill`` (its numerics are in test_prefill_attention.py), never the torch
    ops."""
    cache, q, k, v, meta, _, _ = prefill_case(4, 2, 1, 16, [5, 9], [query_len] * 2, seed=1)
    meta.decode_cpu, meta.decode_or_verify = [decode] * 2, decode
    monkeypatch.setattr(TorchPagedAttention, "forward", None)
    attention = CpuPagedAttention(2, 16, 1, 0.25)
    attention.forward(q, k, v, cache, meta)
    assert [name for name, _ in attention._plan.calls] == ["lo_paged_prefill"]


def test_platform_picks_native_ops_when_they_build(monkeypatch):
    assert CpuPlatform.layer_ops() is CpuLayerOps
    assert CpuPlatform.attention_backend() is CpuPagedAttention
    monkeypatch.setattr(layer_ops, "available", lambda: False)
    assert CpuPlatform.layer_ops() is LayerOps
    assert CpuPlatform.attention_backend() is TorchPagedAttention


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_decode_attention_splits_query_head_groups(monkeypatch, threads, heads, kv_heads):
    """Few sequences on many threads: each kv head's query heads are split into slices."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    dim, seq_lens = 64, [45]
    cache, keys, values, meta = decode_case(4, heads, kv_heads, dim, seq_lens, seed=threads)
    q = torch.randn(1, heads, dim)
    k, v = keys[0][-1:], values[0][-1:]
    out = CpuPagedAttention(heads, dim, kv_heads, 0.125).forward(q, k, v, cache, meta)
    close(out, dense_reference(q, keys, values, 0.125, heads // kv_heads))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_short_queries_match_a_causal_dense_reference(block_size, heads, kv_heads, kv_dtype,
                                                      monkeypatch):
    """A verify step (sequences of 5 and 3 new rows after their context) mixed with decode
    rows: the native kernel, one query row at a time, equals float64 causal attention, and
    every new row's key and value land in its slot."""
    monkeypatch.setattr(TorchPagedAttention, "forward", None)  # the native kernel only
    dim, contexts = 32, [7, 0, 30, 12]
    cache, q, k, v, meta, keys, values = prefill_case(
        block_size, heads, kv_heads, dim, contexts, [5, 1, 3, 1], seed=block_size + heads,
        dtype=kv_dtype)
    meta.decode_or_verify = True
    out = CpuPagedAttention(heads, dim, kv_heads, dim ** -0.5).forward(q, k, v, cache, meta)
    close(out, causal_reference(q, keys, values, contexts, dim ** -0.5, heads // kv_heads,
                                kv_dtype))
    flat = cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat[0, meta.slot_mapping], k.to(kv_dtype))
    assert torch.equal(flat[1, meta.slot_mapping], v.to(kv_dtype))
