"""HPU graphs for bucketed decode steps, through ``habana_frameworks.torch.hpu.wrap_in_hpu_graph``.

The wrapped module records a graph the first time it sees an input signature and replays it
after that; it keys graphs by hashing its arguments, so the step's attention metadata is
passed as tensors (whose shapes are the bucket) and rebuilt inside. Engine warm-up runs every
decode bucket once, so every graph is recorded before the first request. Steps with prompt
chunks run eagerly: their Python control flow depends on the query lengths, which a recorded
graph would freeze. Per-row extras (models/forward_context.py) are not among the graph's
inputs, so a step that carries one runs eagerly too.
"""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.forward_context import ForwardContext
from pagedserve.platforms.hpu.platform import habana_module


class _DecodeStep(torch.nn.Module):
    """The model's decode-only forward over a bucketed batch: one query row per sequence and a
    context of at most the block table's capacity."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 block_size: int) -> None:
        super().__init__()
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                context_lens: torch.Tensor, block_tables: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        capacity = block_tables.shape[1] * self.block_size
        meta = AttentionMetadata(
            num_seqs=n, num_tokens=n, max_query_len=1, max_seq_len=capacity,
            block_size=self.block_size, query_start_loc=query_start_loc, seq_lens=seq_lens,
            context_lens=context_lens, block_tables=block_tables, slot_mapping=slot_mapping,
            query_lens_cpu=[1] * n, seq_lens_cpu=[capacity] * n)
        return self.model(input_ids, positions, self.kv_caches, ForwardContext(meta))


class HpuGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 verify_len: int = 1) -> None:
        # Verify steps (verify_len > 1) are not wrapped: they run eagerly on Gaudi.
        self.block_size = block_size
        self.step = _DecodeStep(model, kv_caches, block_size)

    def capture(self) -> None:
        """Wrap the decode step; each bucket's graph is recorded at its first run (warm-up)."""
        self.step = habana_module("hpu").wrap_in_hpu_graph(self.step)

    def can_run(self, ctx: ForwardContext) -> bool:
        # Bucketed steps only (their max_seq_len is the table's capacity): graphs of
        # unbucketed shapes would pile up without bound.
        meta = ctx.attn
        return (meta.is_decode_only and not ctx.has_row_extras
                and meta.max_seq_len == meta.block_tables.shape[1] * self.block_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.attn
        return self.step(input_ids, positions, meta.query_start_loc, meta.seq_lens,
                         meta.context_lens, meta.block_tables, meta.slot_mapping)
