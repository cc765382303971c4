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
