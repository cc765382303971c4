"""CUDA graphs of an EAGLE-3 head's chained drafting passes (``worker/eagle_drafter.py``).

For each padded batch size one graph runs the passes that draw drafts 2 .. k of a greedy
step: pass j feeds draft j at position ``n + j - 1`` with the previous pass's hidden state,
takes the argmax of the head's logits and maps it to a target id. Everything a pass needs
besides the captured buffers is computed on the device from them: the positions, the
sequence lengths and each row's cache slot (looked up in its block table), so one replay
draws every draft with no host work between passes. A row with fewer drafts than a pass
draws skips its cache write (slot -1: the position may have no block for it), and padded
rows have no drafts at all; their tokens are ignored by the caller.

Sampled (non-greedy) steps, batches past the largest graph and longer chains run eagerly.
"""

from __future__ import annotations

import time

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.logger import get_logger
from pagedserve.models.forward_context import ForwardContext
from pagedserve.platforms.cuda.graphs import capture_sizes

logger = get_logger(__name__)


class ChainGraphs:
    def __init__(self, head: torch.nn.Module, kv_cache: torch.Tensor, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 num_passes: int) -> None:
        self.head, self.kv_cache = head, kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.num_passes = num_passes  # k - 1: drafts 2 .. k
        n, device = self.sizes[-1], kv_cache.device
        hidden_size = head.config.arch.hidden_size
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)  # draft 1, target ids
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # n_i
        self.num_drafts = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, -(-max_model_len // block_size), dtype=torch.int32,
                                        device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.out = torch.zeros(n, num_passes, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _chain(self, bs: int) -> None:
        tokens, hidden = self.tokens[:bs], self.hidden[:bs]
        tables, block = self.block_tables[:bs], self.block_size
        drawn = []
        for j in range(1, self.num_passes + 1):
            pos = self.positions[:bs] + (j - 1)
            blocks = tables.gather(1, (pos // block).unsqueeze(1)).squeeze(1).long()
            slots = torch.where(self.num_drafts[:bs] > j, blocks * block + pos % block, -1)
            seq_lens = (pos + 1).int()
            meta = AttentionMetadata(
                num_seqs=bs, num_tokens=bs, max_query_len=1, max_seq_len=self.max_model_len,
                block_size=block, query_start_loc=self.query_start_loc[:bs + 1],
                seq_lens=seq_lens, context_lens=seq_lens - 1, block_tables=tables,
                slot_mapping=slots, query_lens_cpu=[1] * bs,
                seq_lens_cpu=[self.max_model_len] * bs, decode_or_verify=True)
            normed, hidden = self.head(tokens, pos, hidden, self.kv_cache,
                                       ForwardContext(meta))
            tokens = self.head.draft_to_target[self.head.compute_logits(normed).argmax(-1)]
            drawn.append(tokens)
        self.out[:bs].copy_(torch.stack(drawn, dim=1))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first, so the smaller reuse its pool
            self._chain(bs)  # warm-up outside the capture: Triton compiles here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._chain(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d EAGLE-3 chain graphs of %d passes (batch sizes %d..%d) in "
                    "%.1fs", len(self.graphs), self.num_passes, self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start)

    def can_run(self, num_rows: int, width: int) -> bool:
        return num_rows <= self.sizes[-1] and width - 1 <= self.num_passes

    def run(self, first: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            num_drafts: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Drafts 2 .. k of ``len(first)`` rows (int64 ``[rows, num_passes]``), from draft 1
        (target ids), the hidden state it was drawn with, each row's first input position,
        its number of drafts and its block table."""
        n = len(first)
        bs = next(s for s in self.sizes if s >= n)
        self.tokens[:n].copy_(first)
        self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(positions)
        self.num_drafts[:n].copy_(num_drafts)
        self.positions[n:bs].zero_()
        self.num_drafts[n:bs].zero_()
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        return self.out[:n]
