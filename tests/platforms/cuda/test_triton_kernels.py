"""The Triton paged-attention kernels and backend against float64 references.

Without CUDA the kernels run under Triton's interpreter: tiny shapes, fp32/fp16 and the fp8
cache (the interpreter cannot do bf16, triton-lang/triton#11584). With CUDA the ``cuda`` tests
add bf16 and a wide sweep. Every test poisons the output and the cache's unwritten slots with
NaN, and points unused block-table entries at an all-NaN block, so a missed write or an
out-of-range read shows up as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.devices import HAS_NVIDIA, NVIDIA_REASON, choose_triton_interpreter, interpreter_guards
from tests.sm90_check import run_check

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402

if not IMPORTED_TOO_LATE:
    import pagedserve.platforms.cuda.kernels.decode_attention as decode_mod
    import pagedserve.platforms.cuda.kernels.prefill_attention as prefill_mod
    import pagedserve.platforms.cuda.kernels.reshape_and_cache as cache_mod
    from pagedserve.platforms.cuda.attention import TritonAttentionBackend


_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)


DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
FP8 = torch.float8_e4m3fn
NAN = float("nan")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache should hold for ``x``: the reference for reshape_and_cache."""
    if cache_dtype == FP8:
        return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)
    return x.to(cache_dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.double() * scale if x.dtype == FP8 else x.double()


@dataclass
class Batch:
    """A step's inputs plus the float64 keys/values each sequence should attend over."""

    q: torch.Tensor  # [N, H, D], a strided view of a fused qkv tensor
    k: torch.Tensor  # [N, KVH, D], new keys, likewise a view
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D], context already written
    meta: AttentionMetadata
    ref_k: list[torch.Tensor]  # per sequence [seq_len, KVH, D] float64
    ref_v: list[torch.Tensor]


def _block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator):
    """Shuffled, non-contiguous block ids; block 0 stays unused and padding points at it."""
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(needed) + 3  # spare blocks that nobody owns
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table, num_blocks


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    seed: int = 0,
) -> Batch:
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    table, num_blocks = _block_tables(seq_lens, block_size, gen)
    # Layer 1 of a two-layer pool: the kernels get a view with an offset.
    pool = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_size), NAN)
    pool = pool.to(cache_dtype)
    kv_cache = pool[1]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)

    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads + 1, head_size, generator=gen)
    qkv = qkv.to(dtype)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:-num_kv_heads - 1], qkv[:, -num_kv_heads - 1:-1]
    slots, ref_k, ref_v = [], [], []
    start = 0
    for i, (ctx, qlen) in enumerate(zip(context_lens, query_lens, strict=True)):
        pos = torch.arange(ctx + qlen)
        seq_slots = table[i, pos // block_size].long() * block_size + pos % block_size
        ctx_k, ctx_v = (torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
                        for _ in range(2))
        flat[0, seq_slots[:ctx]] = quantize(ctx_k, cache_dtype, scales[0])
        flat[1, seq_slots[:ctx]] = quantize(ctx_v, cache_dtype, scales[1])
        slots.append(seq_slots[ctx:])
        new_k, new_v = k[start:start + qlen], v[start:start + qlen]
        ref_k.append(torch.cat([dequantize(quantize(t, cache_dtype, scales[0]), scales[0])
                                for t in (ctx_k, new_k)]))
        ref_v.append(torch.cat([dequantize(quantize(t, cache_dtype, scales[1]), scales[1])
                                for t in (ctx_v, new_v)]))
        start += qlen

    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    meta = AttentionMetadata(
        num_seqs=len(seq_lens), num_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc=query_start_loc.to(torch.int32).to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table.to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
    )
    return Batch(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pool.to(DEVICE)[1], meta,
                 ref_k, ref_v)


def ref_attention(batch: Batch, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Causal float64 attention of each sequence's queries over its reference keys; with
    ``window`` a query at position p sees keys p - window + 1 .. p only, with ``softcap`` the
    scaled scores are capped (``AttentionBackend``)."""
    q = batch.q.double().cpu()
    out = torch.empty_like(q)
    group = q.shape[1] // batch.ref_k[0].shape[1]
    starts = batch.meta.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(batch.ref_k, batch.ref_v, strict=True)):
        qi = q[starts[i]:starts[i + 1]]
        ctx = k.shape[0] - qi.shape[0]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        key_pos = torch.arange(k.shape[0])[None, :]
        query_pos = ctx + torch.arange(qi.shape[0])[:, None]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        p = s.masked_fill(~visible, -math.inf).softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def write_new_tokens(batch: Batch, k_scale=None, v_scale=None) -> None:
    cache_mod.reshape_and_cache(batch.k, batch.v, batch.kv_cache[0], batch.kv_cache[1],
                                batch.meta.slot_mapping, k_scale, v_scale)


def scale_tensors(scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.tensor([s], dtype=torch.float32, device=DEVICE) for s in scales)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, fp8: bool) -> None:
    # Low-precision P (probabilities cast to the input dtype for the PV matmul) dominates.
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    if fp8:
        tol = max(tol, 1e-2)
    assert not out.isnan().any(), "NaN in output: unwritten or out-of-range read"
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------- reshape_and_cache

@pytest.mark.parametrize(
    "block_size,dtype,cache_dtype",
    [(8, torch.float32, torch.float32), (16, torch.float16, torch.float16),
     (16, torch.float16, FP8), (32, torch.float32, FP8)],
)
def test_reshape_and_cache(block_size, dtype, cache_dtype):
    batch = make_batch([5, 1, 11], [3, 20, 0], 4, 2, 24, block_size, dtype, cache_dtype)
    scales = (0.05, 2.0)
    before = batch.kv_cache.clone()
    # A padding row (slot -1) must be skipped.
    k = torch.cat([batch.k, torch.full_like(batch.k[:1], 7.0)])
    v = torch.cat([batch.v, torch.full_like(batch.v[:1], 7.0)])
    slots = torch.cat([batch.meta.slot_mapping, torch.tensor([-1], device=DEVICE)])
    cache_mod.reshape_and_cache(k, v, batch.kv_cache[0], batch.kv_cache[1], slots,
                                *scale_tensors(scales))

    nb, bs, kvh, d = batch.kv_cache.shape[1:]
    flat = batch.kv_cache.view(2, nb * bs, kvh, d).cpu()
    old = before.view(2, nb * bs, kvh, d).cpu()
    written = batch.meta.slot_mapping.cpu()
    for idx, (new, s) in enumerate(((batch.k, scales[0]), (batch.v, scales[1]))):
        expect = quantize(new.cpu(), cache_dtype, s).contiguous()
        assert torch.equal(flat[idx, written].view(torch.uint8), expect.view(torch.uint8))
        untouched = torch.ones(nb * bs, dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat[idx, untouched].view(torch.uint8),
                           old[idx, untouched].view(torch.uint8))


def test_fp8_quantize_roundtrip_math():
    """e4m3 keeps 3 mantissa bits: relative error <= 2**-4 in the normal range, and values
    beyond 448 * scale saturate instead of turning into NaN."""
    x = torch.randn(4096, dtype=torch.float64) * 3
    scale = 0.01
    back = dequantize(quantize(x, FP8, scale), scale)
    normal = (x.abs() / scale >= 2.0**-6) & (x.abs() / scale <= 448)
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0**-4).all()
    huge = dequantize(quantize(torch.tensor([1e6, -1e6]), FP8, scale), scale)
    assert torch.equal(huge, torch.tensor([448.0, -448.0], dtype=torch.float64) * scale)


# ---------------------------------------------------------------------------- prefill

# (block_size, num_kv_heads, group, head_size, dtype, block_m, block_n): each exercises a
# different tile edge; query/context lengths are not multiples of the block size.
PREFILL_CPU_CASES = [
    (8, 2, 1, 16, torch.float32, 16, 16),
    (16, 1, 4, 32, torch.float16, 32, 16),
    (32, 2, 2, 64, torch.float32, 16, 32),
    (16, 1, 8, 128, torch.float16, 16, 16),
    (8, 1, 2, 80, torch.float32, 32, 16),  # head size not a power of two
]


def _run_prefill(case, query_lens, context_lens, cache_dtype=None, scales=(1.0, 1.0), seed=0,
                 window=None, softcap=None):
    block_size, kvh, group, head_size, dtype, block_m, block_n = case
    batch = make_batch(query_lens, context_lens, kvh * group, kvh, head_size, block_size, dtype,
                       cache_dtype, scales, seed)
    k_scale, v_scale = scale_tensors(scales)
    write_new_tokens(batch, k_scale, v_scale)
    scale = head_size**-0.5
    out = torch.full_like(batch.q, NAN)
    prefill_mod.prefill_attention(
        batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.meta.block_tables,
        batch.meta.query_start_loc, batch.meta.seq_lens, scale, batch.meta.max_query_len,
        k_scale, v_scale, out=out, block_m=block_m, block_n=block_n, window=window,
        softcap=softcap)
    assert_close(out, ref_attention(batch, scale, window, softcap), dtype, cache_dtype == FP8)


@pytest.mark.parametrize("case", PREFILL_CPU_CASES, ids=str)
def test_prefill_chunked_with_context(case):
    # A fresh prompt, a chunk after cached context, a decode row and a prefix-cache hit.
    _run_prefill(case, query_lens=[13, 9, 1, 20], context_lens=[0, 21, 30, 16])


def test_prefill_fp8_cache():
    case = (16, 2, 2, 32, torch.float16, 16, 16)
    _run_prefill(case, [7, 12], [19, 0], cache_dtype=FP8, scales=(0.02, 0.5))


# ---------------------------------------------------------------------------- decode

# (block_size, num_kv_heads, group, head_size, dtype, partition_size, block_n)
DECODE_CPU_CASES = [
    (8, 2, 1, 16, torch.float32, 32, 16),
    (16, 1, 8, 32, torch.float16, 32, 16),
    (32, 2, 4, 64, torch.float32, 64, 32),
    (16, 1, 2, 128, torch.float16, 32, 32),
    (8, 1, 4, 96, torch.float16, None, None),  # heuristic: one partition, no merge pass
    (8, 1, 4, 64, torch.float16, None, (64, 2, 3)),  # the large-batch tile
    # Several kv heads a program (tile_columns): 4 heads of 16 keys, 2 of 8 over partitions.
    (16, 4, 4, 64, torch.float16, None, (64, 2, 3, 4)),
    (8, 4, 2, 32, torch.float32, 16, (16, 4, 2, 2)),
]


def _run_decode(case, seq_lens, cache_dtype=None, scales=(1.0, 1.0), seed=0, window=None,
                softcap=None):
    block_size, kvh, group, head_size, dtype, partition_size, block_n = case
    batch = make_batch([1] * len(seq_lens), [s - 1 for s in seq_lens], kvh * group, kvh,
                       head_size, block_size, dtype, cache_dtype, scales, seed)
    k_scale, v_scale = scale_tensors(scales)
    write_new_tokens(batch, k_scale, v_scale)
    scale = head_size**-0.5
    # One padding row (seq_len 0, block table all poison) must come back as zeros.
    q = torch.cat([batch.q, torch.full_like(batch.q[:1], 1.0)])
    seq_lens_t = torch.cat([batch.meta.seq_lens, batch.meta.seq_lens.new_zeros(1)])
    tables = torch.cat([batch.meta.block_tables, torch.zeros_like(batch.meta.block_tables[:1])])
    out = torch.full_like(q, NAN)
    decode_mod.decode_attention(
        q, batch.kv_cache[0], batch.kv_cache[1], tables, seq_lens_t, scale,
        batch.meta.max_seq_len, k_scale, v_scale, out=out, partition_size=partition_size,
        config=decode_mod.DecodeConfig(*block_n) if isinstance(block_n, tuple) else
        block_n and decode_mod.DecodeConfig(block_n), window=window, softcap=softcap)
    assert_close(out[:-1], ref_attention(batch, scale, window, softcap), dtype,
                 cache_dtype == FP8)
    assert torch.equal(out[-1].cpu(), torch.zeros_like(out[-1].cpu()))


@pytest.mark.parametrize("case", DECODE_CPU_CASES, ids=str)
def test_decode(case):
    _run_decode(case, seq_lens=[1, 17, 70, 45])


@pytest.mark.parametrize("tile", [(16, 2, 2), (16, 4, 2), (32, 2, 3), (64, 2, 3, 4)],
                         ids=str)
def test_decode_fp8_cache(tile):
    # Partitions of whole tiles and a ragged last one: the loop and the tail; with 4 kv heads a
    # program, 4 x 16 keys a step.
    kvh = tile[3] if len(tile) > 3 else 2
    _run_decode((16, kvh, 2, 32, torch.float16, 32, tile), [50, 3, 32, 61], FP8,
                scales=(0.03, 0.4))


def test_prefill_restricted_to_some_sequences():
    """``seq_ids`` computes those sequences' rows and leaves every other row unwritten."""
    block_size, kvh, group, head_size = 8, 2, 2, 32
    query_lens, context_lens = [4, 1, 7, 1, 3], [5, 12, 0, 30, 9]
    batch = make_batch(query_lens, context_lens, kvh * group, kvh, head_size, block_size,
                       torch.float32)
    write_new_tokens(batch)
    out = torch.full_like(batch.q, NAN)
    seq_ids = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    prefill_mod.prefill_attention(
        batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.meta.block_tables,
        batch.meta.query_start_loc, batch.meta.seq_lens, head_size**-0.5,
        batch.meta.max_query_len, out=out, block_m=16, block_n=16, seq_ids=seq_ids)
    starts = batch.meta.query_start_loc.tolist()
    computed = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    for i in seq_ids.tolist():
        computed[starts[i]:starts[i + 1]] = True
    ref = ref_attention(batch, head_size**-0.5)
    assert_close(out.cpu()[computed], ref[computed], torch.float32, False)
    assert out.cpu()[~computed].isnan().all()


# ------------------------------------------------------------- sliding window and score cap

# (window, softcap): windows shorter than a key tile and than a block, not multiples of the
# block size, and a cap small enough (scores of a few units) to bend every score.
WINDOWS = [(5, None), (20, 3.0), (None, 2.0)]


@pytest.mark.parametrize("window,softcap", WINDOWS, ids=str)
def test_prefill_window_and_softcap(window, softcap):
    """Prompts past the window, a chunk whose first row's window starts inside the cached
    context (21 cached, window 20), a decode row and a prefix-cache hit, over tiles of 16
    queries and 16 keys: every tile of the window's edge, the unmasked middle and the
    diagonal."""
    _run_prefill((8, 2, 2, 16, torch.float32, 16, 16), [13, 9, 1, 20, 40], [0, 21, 30, 16, 3],
                 window=window, softcap=softcap)


@pytest.mark.parametrize("window,softcap", WINDOWS, ids=str)
def test_decode_window_over_many_blocks_and_partitions(window, softcap):
    """Contexts of up to 17 blocks of 8 in partitions of 16 keys: the window (not a multiple
    of the block) starts mid-block and mid-partition, and the merge counts only the window's
    partitions."""
    _run_decode((8, 2, 2, 16, torch.float32, 16, 16), [1, 17, 70, 45, 133], window=window,
                softcap=softcap)


def test_decode_window_and_softcap_fp8_packed_heads():
    """The fp8 cache's word-pair tiles and two kv heads a program, windowed and capped."""
    _run_decode((16, 4, 2, 32, torch.float16, 32, (16, 4, 2, 2)), [50, 3, 32, 61], FP8,
                scales=(0.03, 0.4), window=21, softcap=2.5)


@pytest.mark.parametrize("decode_or_verify", [False, True])
def test_backend_window_and_softcap(decode_or_verify):
    """A mixed step (its one-row sequences through the decode kernel) and a verify step (row
    by row through it), windowed and capped, against the float64 reference."""
    query_lens, context_lens = [1, 6, 1, 9], [40, 10, 3, 30]
    batch = make_batch(query_lens, context_lens, 4, 2, 32, 8, torch.float16, seed=6)
    batch.meta.decode_or_verify = decode_or_verify
    assert_close(_backend_step(batch, "auto", window=13, softcap=2.0),
                 ref_attention(batch, 32**-0.5, 13, 2.0), torch.float16, False)


def test_partition_size_heuristic_fills_the_gpu():
    pick = decode_mod.pick_partition_size
    # Batch 1, 8 kv heads, 32k context on 132 SMs: enough programs for every SM.
    size = pick(1, 8, 32768, 132, 64)
    assert 8 * math.ceil(32768 / size) >= 2 * 132
    assert pick(1, 8, 300, 132, 64) == decode_mod.MIN_PARTITION_SIZE
    assert pick(256, 8, 4096, 132, 64) >= 4096  # large batches skip the merge pass


# ---------------------------------------------------------------------------- backend

def _backend_step(batch: Batch, kv_cache_dtype: str, scales=(1.0, 1.0), window=None,
                  softcap=None) -> torch.Tensor:
    num_heads, head_size = batch.q.shape[1:]
    backend = TritonAttentionBackend(num_heads, head_size, batch.k.shape[1], head_size**-0.5,
                                     kv_cache_dtype=kv_cache_dtype)
    backend.set_kv_scales(*scales)
    return backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, window,
                           softcap)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3"])
def test_backend_mixed_then_decode(kv_cache_dtype):
    cache_dtype = FP8 if kv_cache_dtype.startswith("fp8") else None
    scales = (0.05, 0.2) if cache_dtype else (1.0, 1.0)
    mixed = make_batch([6, 1], [10, 25], 4, 2, 32, 8, torch.float16, cache_dtype, scales)
    assert_close(_backend_step(mixed, kv_cache_dtype, scales),
                 ref_attention(mixed, 32**-0.5), torch.float16, cache_dtype is not None)
    decode = make_batch([1, 1, 1], [40, 0, 9], 4, 2, 32, 16, torch.float16, cache_dtype,
                        scales, seed=1)
    assert decode.meta.is_decode_only
    assert_close(_backend_step(decode, kv_cache_dtype, scales),
                 ref_attention(decode, 32**-0.5), torch.float16, cache_dtype is not None)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_backend_mixed_step_sends_one_row_sequences_to_the_decode_kernel(kv_cache_dtype,
                                                                       monkeypatch):
    """Decodes between prompt chunks: the decode kernel gets exactly the one-row sequences
    (their rows, tables and lengths), the prefill kernel the rest, and every row matches the
    float64 reference."""
    import pagedserve.platforms.cuda.attention as backend_mod

    cache_dtype = FP8 if kv_cache_dtype == "fp8" else None
    scales = (0.05, 0.2) if cache_dtype else (1.0, 1.0)
    query_lens, context_lens = [1, 6, 1, 1, 9, 1], [40, 10, 3, 0, 0, 21]
    batch = make_batch(query_lens, context_lens, 4, 2, 32, 8, torch.float16, cache_dtype,
                       scales, seed=5)
    seen = []

    def spy(q, key_cache, value_cache, tables, lens, *args, **kwargs):
        seen.append(lens.tolist())
        return decode_mod.decode_attention(q, key_cache, value_cache, tables, lens, *args,
                                           **kwargs)

    monkeypatch.setattr(backend_mod, "decode_attention", spy)
    out = _backend_step(batch, kv_cache_dtype, scales)
    assert seen == [[41, 4, 1, 22]]
    assert_close(out, ref_attention(batch, 32**-0.5), torch.float16, cache_dtype is not None)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("query_lens, context_lens", [([5], [40]), ([5, 3, 1, 4], [9, 0, 33, 17])],
                         ids=["batch1", "batch4"])
def test_backend_verify_rows_through_the_decode_kernel(kv_cache_dtype, query_lens,
                                                       context_lens):
    """A small verify batch (decode_or_verify) attends row by row with the decode kernel: each
    row sees its context and the rows before it, as the float64 reference says."""
    cache_dtype = FP8 if kv_cache_dtype == "fp8" else None
    scales = (0.05, 0.2) if cache_dtype else (1.0, 1.0)
    batch = make_batch(query_lens, context_lens, 4, 2, 32, 8, torch.float16, cache_dtype,
                       scales, seed=3)
    batch.meta.decode_or_verify = True
    assert not batch.meta.is_decode_only
    assert_close(_backend_step(batch, kv_cache_dtype, scales), ref_attention(batch, 32**-0.5),
                 torch.float16, cache_dtype is not None)


def test_backend_rejects_mismatched_cache_dtype():
    batch = make_batch([1], [4], 2, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _backend_step(batch, "fp8")
    with pytest.raises(ValueError, match="choose one of"):
        TritonAttentionBackend(2, 16, 1, 1.0, kv_cache_dtype="int4")


# ---------------------------------------------------------------------------- CUDA sweep

# Two slices instead of the full product, to keep compile time sane: every block size and GQA
# ratio at head size 128 in bf16, then every head size and dtype at block 16, GQA 4.
SWEEP_CASES = [(bs, g, 128, torch.bfloat16, None) for bs in (8, 16, 32) for g in (1, 2, 4, 8)]
SWEEP_CASES += [
    (16, 4, head_size, dtype, cache_dtype)
    for head_size in (64, 96, 128, 256)
    for dtype, cache_dtype in [(torch.float16, None), (torch.float32, None),
                               (torch.bfloat16, FP8), (torch.float16, FP8)]
]


@cuda
@needs_cuda
@pytest.mark.parametrize("block_size,group,head_size,dtype,cache_dtype", SWEEP_CASES, ids=str)
def test_prefill_sweep_cuda(block_size, group, head_size, dtype, cache_dtype):
    case = (block_size, 2, group, head_size, dtype, None, None)
    scales = (0.05, 0.3) if cache_dtype else (1.0, 1.0)
    _run_prefill(case, [300, 1, 77, 129, 5], [0, 1000, 513, 37, 2], cache_dtype, scales)


@cuda
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["auto", "fp8"])
@pytest.mark.parametrize("tile", [(64, 2, 3, 4), (128, 2, 3, 4), (64, 2, 3, 2), (128, 4, 3, 4)],
                         ids=str)
def test_decode_packed_heads_cuda(tile, cache_dtype):
    # The 8B shape's GQA (8 kv heads, 4 query heads each) with several kv heads a program, at
    # contexts around a large batch's and past them, one and several partitions.
    scales = (0.05, 0.3) if cache_dtype else (1.0, 1.0)
    for partition_size in (None, 128):
        _run_decode((16, 8, 4, 128, torch.bfloat16, partition_size, tile),
                    [129, 256, 1, 17, 200, 4097, 160], cache_dtype, scales)


@cuda
@needs_cuda
@pytest.mark.parametrize("block_size,group,head_size,dtype,cache_dtype", SWEEP_CASES, ids=str)
def test_decode_sweep_cuda(block_size, group, head_size, dtype, cache_dtype):
    case = (block_size, 2, group, head_size, dtype, None, None)
    scales = (0.05, 0.3) if cache_dtype else (1.0, 1.0)
    _run_decode(case, [1, 4097, 333, 2000, 17], cache_dtype, scales)


@cuda
@needs_cuda
@pytest.mark.parametrize("partition_size", [128, 512, 2048])
def test_decode_long_context_cuda(partition_size):
    case = (16, 8, 4, 128, torch.bfloat16, partition_size, None)
    _run_decode(case, [32768, 9000])


@cuda
@needs_cuda
@pytest.mark.parametrize("query_lens, context_lens", [([5], [520]), ([9, 9, 2], [4000, 7, 1])])
def test_backend_verify_rows_cuda(query_lens, context_lens):
    batch = make_batch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, seed=4)
    batch.meta.decode_or_verify = True
    assert_close(_backend_step(batch, "auto"), ref_attention(batch, 128**-0.5), torch.bfloat16,
                 False)


@cuda
@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_backend_cuda(kv_cache_dtype):
    cache_dtype = FP8 if kv_cache_dtype == "fp8" else None
    scales = (0.05, 0.2) if cache_dtype else (1.0, 1.0)
    # Decodes among prompt chunks: the decode kernel takes them, 2 of the prefill kernel's 4.
    mixed = make_batch([200, 1, 1, 64, 1], [0, 700, 3, 100, 5000], 32, 8, 128, 16,
                       torch.bfloat16, cache_dtype, scales)
    assert_close(_backend_step(mixed, kv_cache_dtype, scales),
                 ref_attention(mixed, 128**-0.5), torch.bfloat16, cache_dtype is not None)


# The decode attention kernel's default tiles built for sm_90 as the 8B launch specializes them,
# no GPU needed (scripts/attention_resources.py --check): none spills, and the loop's loads
# are copied ahead. A launch that stopped specializing its strides (do_not_specialize on the
# cache's) would lose both: its loads could no longer be vectorized.
@pytest.mark.slow
def test_decode_attention_defaults_compile_pipelined_for_sm90():
    run_check("attention_resources.py")

