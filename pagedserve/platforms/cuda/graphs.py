"""CUDA graphs for decode steps, and for speculative decoding's verify steps.

Each captured graph runs one decode step for a fixed padded batch size over persistent input
buffers. Replay copies the step's inputs into those buffers; padded rows get slot -1 (the cache
write skips them) and a context of one token, and their outputs are dropped. The decode grid is
sized for ``max_model_len`` so one graph serves every context length.

With ``verify_len`` Q above 1, a second set of graphs runs verify steps: every sequence brings
up to Q tokens after its cached context (its last token and its drafts), padded to exactly Q
rows, so the varlen attention kernel runs at one shape per batch size. A sequence's row r sits
at row ``i * Q + r``; the rows past its own tokens sit after them (positions past its end,
slot -1, never written), so causal attention keeps them out of its real rows, and their
outputs are dropped. The graphs are captured
with a ``ForwardContext`` over those buffers, both per-row extras included: LoRA slots (a
buffer of -1 where a row or a whole step has no adapter: plain linear layers ignore it, LoRA
layers group its rows inside the graph) and Phi-3 longrope's long-prompt flags (False where a
row's sequence has a short prompt; rotary tables without long factors ignore it), so steps
with adapters or long prompts replay too (models/forward_context.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.logger import get_logger
from pagedserve.models.forward_context import ForwardContext

logger = get_logger(__name__)


def _padded_rows(query_lens: list[int], width: int, device: torch.device) -> torch.Tensor:
    """int64: the padded row of each real row, sequence i's row r at ``i * width + r``."""
    lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.repeat(np.arange(len(lens)) * width - (np.cumsum(lens) - lens), lens)
    rows = starts + np.arange(lens.sum())  # row j of the step, sequence i: j + i*width - start_i
    return torch.from_numpy(rows).to(device, non_blocking=True)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 verify_len: int = 1) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        # Query lengths with graphs: 1 (decode), and Q = verify_len where drafts are verified.
        self.query_lens = [1] + ([verify_len] if verify_len > 1 else [])
        device = kv_caches[0].device
        n = self.sizes[-1]
        rows = n * self.query_lens[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = {q: torch.arange(0, q * (n + 1), q, dtype=torch.int32,
                                                device=device) for q in self.query_lens}
        self.lora_slots = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.long_rope = torch.zeros(rows, dtype=torch.bool, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph,
                                                 torch.Tensor | tuple[torch.Tensor, ...]]] = {}

    def _meta(self, bs: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=bs, num_tokens=bs * q, max_query_len=q, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=self.query_start_loc[q][:bs + 1],
            seq_lens=self.seq_lens[:bs], context_lens=self.seq_lens[:bs] - q,
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs * q],
            query_lens_cpu=[q] * bs, seq_lens_cpu=[self.max_model_len] * bs,
            decode_or_verify=True)

    def _forward(self, bs: int, q: int) -> torch.Tensor:
        rows = bs * q
        return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches,
                          ForwardContext(self._meta(bs, q), lora_slots=self.lora_slots[:rows],
                                         long_rope=self.long_rope[:rows]))

    @torch.inference_mode()
    def capture(self) -> None:
        from pagedserve.platforms.cuda.kernels.pdl import graph_scope  # needs triton

        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse its memory pool.
        for q in reversed(self.query_lens):
            self.seq_lens.fill_(q)  # a context of none: the warm-up reads no stale block
            for bs in reversed(self.sizes):
                with graph_scope(bs * q):  # small steps' kernels launch with PDL
                    self._forward(bs, q)  # warm-up: Triton compiles outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bs, q)
                self.graphs[bs, q] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %d..%d, query lengths %s) in %.1fs",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.query_lens,
                    time.perf_counter() - start)

    def can_run(self, ctx: ForwardContext) -> bool:
        meta = ctx.attn  # the graphs hold buffers for every per-row extra
        if meta.num_seqs > self.sizes[-1]:
            return False
        return meta.is_decode_only or (meta.max_query_len <= self.query_lens[-1] and all(
            q < s for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu)))  # verify steps

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.attn
        n = meta.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        if meta.is_decode_only:
            q, rows = 1, slice(0, n)
            self.positions[:n].copy_(positions, non_blocking=True)
            self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        else:
            q = self.query_lens[-1]
            rows = _padded_rows(meta.query_lens_cpu, q, input_ids.device)
            # Every padded row at its place after its sequence's context.
            context = meta.context_lens.long()
            self.positions[:n * q].copy_(
                (context[:, None] + torch.arange(q, device=context.device)).flatten())
            self.seq_lens[:n].copy_(meta.context_lens + q)
        self.seq_lens[n:bs].fill_(q)
        self.slot_mapping[:bs * q].fill_(-1)
        self.slot_mapping[rows] = meta.slot_mapping
        self.input_ids[rows] = input_ids
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.lora_slots[:bs * q].fill_(-1)
        if ctx.lora_slots is not None:
            self.lora_slots[rows] = ctx.lora_slots
        self.long_rope[:bs * q].fill_(False)
        if ctx.long_rope is not None:
            self.long_rope[rows] = ctx.long_rope
        graph, out = self.graphs[bs, q]
        graph.replay()
        # A model may also return the auxiliary hidden states an EAGLE-3 head reads.
        return tuple(t[rows] for t in out) if isinstance(out, tuple) else out[rows]
