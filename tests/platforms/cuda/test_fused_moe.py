"""The Triton mixture-of-experts kernel (``kernels/fused_moe.py``) and its row layout
(``kernels/moe_align.py``) against independent references: the layout against a Python loop
over experts, exactly; the layer against a float64 loop over each token's top-k experts
(``tests/models/test_moe.py``'s).

Without an NVIDIA GPU the kernels run under Triton's interpreter in float32 and float16 (it
cannot do bf16, triton-lang/triton#11584); with one, bf16, model-sized shapes and CUDA-graph
replay under changing routings join. The comparisons are shown able to fail: with a wrong
expert for each block of rows, or the routing weights left out, the same check refuses.
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import HAS_NVIDIA, NVIDIA_REASON, choose_triton_interpreter, interpreter_guards
from tests.models.test_moe import expert_weights, reference_moe

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

if not IMPORTED_TOO_LATE:
    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.platforms.cuda.kernels import fused_moe as moe
    from pagedserve.platforms.cuda.kernels.device import gpu_arch, shared_memory_bytes
    from pagedserve.platforms.cuda.kernels.moe_align import align_pairs, max_rows
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_NVIDIA else [])
# Against float64: each GEMM's output, SwiGLU's and the sum rounded to the activation dtype.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (tokens, experts, top_k, hidden, intermediate, routing): odd token counts, intermediate sizes
# that no tile divides, experts with no pairs and one expert in every token's top-k.
SHAPES = [
    (1, 8, 2, 64, 48, "random"),
    (3, 16, 8, 32, 40, "half_idle"),
    (17, 8, 1, 64, 48, "one_takes_all"),
    (17, 16, 2, 48, 24, "half_idle"),
    (70, 16, 8, 32, 24, "one_takes_all"),
    (65, 8, 2, 64, 40, "random"),
] + ([(1, 8, 2, 4096, 1000, "random"), (300, 128, 8, 2048, 768, "random"),
      (2048, 8, 2, 1024, 1792, "one_takes_all")] if HAS_NVIDIA else [])


def routing(tokens: int, experts: int, top_k: int, kind: str, seed: int = 0):
    """``(topk_ids [T, K], float32 weights [T, K])``. ``half_idle``: the upper half of the
    experts gets nothing (where ``top_k`` leaves them out); ``one_takes_all``: expert 3 is in
    every token's top-k."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if kind == "half_idle":
        scores[:, experts // 2:] -= 2
    elif kind == "one_takes_all":
        scores[:, 3] += 2
    ids = scores.topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids.to(DEVICE), weights.to(DEVICE)


def problem(tokens, experts, top_k, hidden, inter, kind, dtype, seed=0):
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device=DEVICE, dtype=dtype)
    return (x, w13.to(DEVICE), w2.to(DEVICE), *routing(tokens, experts, top_k, kind, seed))


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def expected_layout(ids: torch.Tensor, experts: int, block_m: int):
    """The aligned rows and the expert of each block, by a loop over experts."""
    flat = ids.flatten().tolist()
    rows, blocks = [], []
    for e in range(experts):
        mine = [p for p, expert in enumerate(flat) if expert == e]
        padded = -(-len(mine) // block_m) * block_m
        rows += mine + [len(flat)] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    return rows, blocks


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,experts,top_k,kind", [
    (1, 8, 2, "random"), (5, 8, 1, "random"), (17, 16, 2, "half_idle"),
    (40, 8, 8, "one_takes_all"), (33, 128, 8, "random")])
def test_align_pairs_matches_a_loop_over_experts(tokens, experts, top_k, kind, block_m):
    ids, _ = routing(tokens, experts, top_k, kind)
    aligned = align_pairs(ids, experts, block_m)
    rows, blocks = expected_layout(ids, experts, block_m)
    pairs, total = tokens * top_k, len(rows)
    assert aligned.total.tolist() == [total]
    assert aligned.sorted_ids.numel() == max_rows(pairs, experts, block_m) >= total
    assert aligned.sorted_ids[:total].tolist() == rows
    assert set(aligned.sorted_ids[total:].tolist()) <= {pairs}
    assert aligned.block_experts[:total // block_m].tolist() == blocks
    assert set(aligned.block_experts[total // block_m:].tolist()) <= {experts}


def test_the_bound_is_reached_when_each_pair_has_an_expert_of_its_own():
    ids = torch.tensor([[5, 0], [7, 2], [1, 6]], device=DEVICE)
    aligned = align_pairs(ids, 8, 16)
    assert aligned.total.tolist() == [6 * 16] == [aligned.sorted_ids.numel()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,kind", SHAPES)
def test_fused_moe_matches_float64(tokens, experts, top_k, hidden, inter, kind, dtype):
    x, w13, w2, ids, weights = problem(tokens, experts, top_k, hidden, inter, kind, dtype)
    got = moe.fused_moe(x, w13, w2, ids, weights)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, reference_moe(x, w13, w2, ids, weights), dtype)


@pytest.mark.parametrize("cfg", [c for _, c in moe._CONFIGS] if not IMPORTED_TOO_LATE else [],
                         ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
def test_every_tile_configuration(cfg):
    """Each row of the table on one shape, whatever the step's size would pick, fit to the
    dtype and the GPU as a launch fits it (the raw rows at float32 overflow an H100's shared
    memory); hidden and intermediate sizes both multiples of every block of K (the unmasked
    loop)."""
    x, w13, w2, ids, weights = problem(37, 8, 2, 128, 64, "half_idle", torch.float32)
    cfg = moe.fit(cfg, torch.float32, gpu_arch(DEVICE), shared_memory_bytes(DEVICE))
    got = moe.fused_moe_with(cfg, x, w13, w2, ids, weights)
    close(got, reference_moe(x, w13, w2, ids, weights), torch.float32)


def test_stages_fit_the_shared_memory_of_the_gpu():
    """The prefill tiles (128 x 64 and 64 x 256 bf16: 48 KiB a stage) at 4 stages on an
    H100's 227 KiB, 3 on an A100's 163; AMD GPUs take 2 whatever the size."""
    h100, a100 = 232448, 166912
    assert moe.moe_config(1000, torch.bfloat16, None, h100).num_stages == 4
    assert moe.moe_config(1000, torch.bfloat16, None, a100).num_stages == 3
    assert moe.moe_config(1000, torch.bfloat16, None, None).num_stages == 4
    assert moe.moe_config(1000, torch.bfloat16, "gfx942", h100).num_stages == 2
    assert moe.moe_config(1000, torch.float32, None, a100).block_k == 32


def test_a_wrong_expert_per_block_fails_the_comparison(monkeypatch):
    x, w13, w2, ids, weights = problem(17, 8, 2, 64, 48, "random", torch.float32)
    expected = reference_moe(x, w13, w2, ids, weights)
    close(moe.fused_moe(x, w13, w2, ids, weights), expected, torch.float32)

    def shifted(*args):
        aligned = align_pairs(*args)
        return aligned._replace(block_experts=(aligned.block_experts + 1) % 8)

    monkeypatch.setattr(moe, "align_pairs", shifted)
    with pytest.raises(AssertionError):
        close(moe.fused_moe(x, w13, w2, ids, weights), expected, torch.float32)


def test_leaving_out_the_routing_weights_fails_the_comparison(monkeypatch):
    x, w13, w2, ids, weights = problem(17, 8, 2, 64, 48, "random", torch.float32)
    expected = reference_moe(x, w13, w2, ids, weights)
    gemm = moe._gemm

    def unweighted(*args):
        gemm(*args[:-1], None)

    monkeypatch.setattr(moe, "_gemm", unweighted)
    with pytest.raises(AssertionError):
        close(moe.fused_moe(x, w13, w2, ids, weights), expected, torch.float32)


def test_the_same_bits_every_run_and_no_tokens():
    x, w13, w2, ids, weights = problem(17, 16, 8, 32, 24, "random", torch.float32)
    first = moe.fused_moe(x, w13, w2, ids, weights)
    assert torch.equal(moe.fused_moe(x, w13, w2, ids, weights), first)
    none = moe.fused_moe(x[:0], w13, w2, ids[:0], weights[:0])
    assert none.shape == (0, 32)


def test_the_platform_runs_the_kernel_inside_graphs():
    assert TritonLayerOps.fused_moe is moe.fused_moe
    assert TritonLayerOps.fused_moe_in_graphs and not LayerOps.fused_moe_in_graphs


def test_mixed_dtypes_are_refused():
    x, w13, w2, ids, weights = problem(3, 8, 2, 32, 16, "random", torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        moe.fused_moe(x.half(), w13, w2, ids, weights)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (8, 128, 8), (256, 8, 2)])
def test_a_cuda_graph_replays_any_routing(tokens, experts, top_k):
    """Captured with one routing, replayed with others (all to one expert, half idle, random):
    the bits of an eager call on each."""
    x, w13, w2, ids, weights = problem(tokens, experts, top_k, 1024, 704, "random",
                                       torch.bfloat16)
    moe.fused_moe(x, w13, w2, ids, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, ids, weights)
    for seed, kind in enumerate(("one_takes_all", "half_idle", "random"), start=1):
        new_ids, new_weights = routing(tokens, experts, top_k, kind, seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        assert torch.equal(out, moe.fused_moe(x, w13, w2, ids, weights))
        close(out, reference_moe(x, w13, w2, ids, weights), torch.bfloat16)
