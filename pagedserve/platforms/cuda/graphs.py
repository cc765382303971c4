"""CUDA graphs for decode steps.

Each captured graph runs one decode step for a fixed padded batch size over persistent input
buffers. Replay copies the step's inputs into those buffers; padded rows get slot -1 (the cache
write skips them) and a context of one token, and their outputs are dropped. The decode grid is
sized for ``max_model_len`` so one graph serves every context length. The graphs are captured
with a ``ForwardContext`` over those buffers, LoRA slots included (a buffer of -1 where a row
or a whole step has no adapter: plain linear layers ignore it, LoRA layers group its rows
inside the graph), so steps with adapters replay too; a step with any other per-row extra runs
eagerly (models/forward_context.py).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.logger import get_logger
from pagedserve.models.forward_context import ForwardContext

logger = get_logger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        device = kv_caches[0].device
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=bs, num_tokens=bs, max_query_len=1, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], context_lens=self.seq_lens[:bs] - 1,
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            query_lens_cpu=[1] * bs, seq_lens_cpu=[self.max_model_len] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches,
                          ForwardContext(self._meta(bs), lora_slots=self.lora_slots[:bs]))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse its memory pool.
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bs)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1fs", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def can_run(self, ctx: ForwardContext) -> bool:
        meta = ctx.attn
        extras = dataclasses.replace(ctx, lora_slots=None).has_row_extras  # others than LoRA's
        return meta.is_decode_only and meta.num_seqs <= self.sizes[-1] and not extras

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.attn
        n = meta.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if ctx.lora_slots is None:
            self.lora_slots[:bs].fill_(-1)
        else:
            self.lora_slots[:n].copy_(ctx.lora_slots, non_blocking=True)
            self.lora_slots[n:bs].fill_(-1)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
