"""Graph runners replay steps whose forward context they captured: a decode step with no
per-row extras or only those their graphs hold buffers for, never one that carries an extra
their graphs hold no buffer for (it runs eagerly). Checked on the CPU: ``can_run`` reads only
the context."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.forward_context import ForwardContext

BLOCK, WIDTH = 16, 4


def _decode_context(num_seqs: int) -> ForwardContext:
    i32 = torch.int32
    return ForwardContext(AttentionMetadata(
        num_seqs=num_seqs, num_tokens=num_seqs, max_query_len=1, max_seq_len=BLOCK * WIDTH,
        block_size=BLOCK, query_start_loc=torch.arange(num_seqs + 1, dtype=i32),
        seq_lens=torch.full((num_seqs,), 5, dtype=i32),
        context_lens=torch.full((num_seqs,), 4, dtype=i32),
        block_tables=torch.zeros(num_seqs, WIDTH, dtype=i32),
        slot_mapping=torch.arange(num_seqs), query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=[5] * num_seqs))


# CUDA graphs hold a buffer for the LoRA slots (graphs.py); Gaudi's hold none.
@pytest.mark.parametrize("module,name,replays_lora", [("cuda", "CudaGraphRunner", True),
                                                       ("hpu", "HpuGraphRunner", False)])
def test_graph_runners_leave_steps_with_row_extras_to_the_eager_path(module, name,
                                                                     replays_lora):
    import importlib

    runner_cls = getattr(importlib.import_module(f"pagedserve.platforms.{module}.graphs"), name)
    runner = runner_cls(torch.nn.Identity(), [torch.zeros(1)], max_num_seqs=4,
                        max_model_len=BLOCK * WIDTH, block_size=BLOCK)
    ctx = _decode_context(3)
    assert runner.can_run(ctx)
    ctx.lora_slots = torch.tensor([0, -1, 1], dtype=torch.int32)
    assert runner.can_run(ctx) == replays_lora


def _verify_context(query_lens: list[int], context: int = 20) -> ForwardContext:
    i32 = torch.int32
    n = len(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=i32)
    return ForwardContext(AttentionMetadata(
        num_seqs=n, num_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=BLOCK * WIDTH, block_size=BLOCK, query_start_loc=starts,
        seq_lens=torch.tensor([context + q for q in query_lens], dtype=i32),
        context_lens=torch.full((n,), context, dtype=i32),
        block_tables=torch.zeros(n, WIDTH, dtype=i32),
        slot_mapping=torch.arange(sum(query_lens)), query_lens_cpu=list(query_lens),
        seq_lens_cpu=[context + q for q in query_lens]))


def test_cuda_graphs_replay_verify_steps_up_to_their_query_length_only():
    """With verify_len 5, a step whose sequences each bring at most 5 tokens after a cached
    context replays; a longer chunk, or a prompt chunk without context, runs eagerly."""
    from pagedserve.platforms.cuda.graphs import CudaGraphRunner, _padded_rows

    runner = CudaGraphRunner(torch.nn.Identity(), [torch.zeros(1)], max_num_seqs=4,
                             max_model_len=BLOCK * WIDTH, block_size=BLOCK, verify_len=5)
    assert runner.can_run(_verify_context([5, 1, 3]))
    assert not runner.can_run(_verify_context([6, 1]))
    assert not runner.can_run(_verify_context([3, 2], context=0))  # prompts: no context
    plain = CudaGraphRunner(torch.nn.Identity(), [torch.zeros(1)], max_num_seqs=4,
                            max_model_len=BLOCK * WIDTH, block_size=BLOCK)
    assert not plain.can_run(_verify_context([2, 1]))
    assert _padded_rows([2, 1, 3], 4, torch.device("cpu")).tolist() == [0, 1, 4, 8, 9, 10]
