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


# CUDA graphs hold buffers for the LoRA slots and longrope's flags (graphs.py); Gaudi's hold
# none.
@pytest.mark.parametrize("module,name,replays_extras", [("cuda", "CudaGraphRunner", True),
                                                         ("hpu", "HpuGraphRunner", False)])
@pytest.mark.parametrize("extra", ["lora_slots", "long_rope"])
def test_graph_runners_leave_steps_with_row_extras_to_the_eager_path(module, name,
                                                                     replays_extras, extra):
    import importlib

    runner_cls = getattr(importlib.import_module(f"pagedserve.platforms.{module}.graphs"), name)
    runner = runner_cls(torch.nn.Identity(), [torch.zeros(1)], max_num_seqs=4,
                        max_model_len=BLOCK * WIDTH, block_size=BLOCK)
    ctx = _decode_context(3)
    assert runner.can_run(ctx)
    value = {"lora_slots": torch.tensor([0, -1, 1], dtype=torch.int32),
             "long_rope": torch.tensor([True, False, True])}[extra]
    setattr(ctx, extra, value)
    assert runner.can_run(ctx) == replays_extras


class _ContextRecorder(torch.nn.Module):
    """A model that keeps a copy of each forward's per-row extras and returns its positions."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[list[int], list[bool]]] = []

    def forward(self, input_ids, positions, kv_caches, ctx):
        self.seen.append((ctx.lora_slots.tolist(), ctx.long_rope.tolist()))
        return positions[:, None].float()


class _ReplayEagerly:
    """In place of a captured graph: replay runs the captured forward over the buffers."""

    def __init__(self, forward) -> None:
        self.forward = forward

    def replay(self) -> None:
        self.forward()


def test_cuda_graph_replay_carries_each_steps_long_rope_flags_and_clears_them():
    """A replayed step sees its rows' longrope flags in the graph's buffer, the padded row
    False, and the next step without long prompts sees none left over."""
    from pagedserve.platforms.cuda.graphs import CudaGraphRunner

    model = _ContextRecorder()
    runner = CudaGraphRunner(model, [torch.zeros(1)], max_num_seqs=4,
                             max_model_len=BLOCK * WIDTH, block_size=BLOCK)
    runner.graphs[4, 1] = (_ReplayEagerly(lambda: runner._forward(4, 1)), torch.zeros(4, 1))
    ctx = _decode_context(3)
    ctx.long_rope = torch.tensor([True, False, True])
    runner.run(torch.zeros(3, dtype=torch.int64), torch.tensor([70, 8, 65]), ctx)
    runner.run(torch.zeros(3, dtype=torch.int64), torch.tensor([71, 9, 66]), _decode_context(3))
    assert [long for _, long in model.seen] == [[True, False, True, False], [False] * 4]
    assert all(slots == [-1] * 4 for slots, _ in model.seen)


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
