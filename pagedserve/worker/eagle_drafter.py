"""EAGLE-3 drafting (``method: eagle3``), run by the driver: a one-layer head
(``models/eagle3.py``) that drafts from the target's hidden states.

The head at position q reads the target's fused hidden state at q and the token at q + 1, so
its pass over a step's positions can only run once the step has sampled (the token after the
last accepted one is the sampled one). Each step therefore has two parts:

- **extend**, after the target's step has sampled (``ModelRunner.sample``): the head runs over
  every position the target just computed, with the step's own attention metadata (the head's
  one-layer pool is addressed by the target's block tables and slots, like the draft model's
  pool in ``drafter.py``), the tokens shifted by one: each chunk's next prompt token after a
  chunk that samples nothing, the sampled tokens at the sample positions. That writes the
  head's keys and values where the target wrote its own, and leaves, per sequence that
  sampled, the head's state at its last accepted position (``num_emitted - 1`` into a verify
  row's positions, found on the device): its hidden state before the final norm and its logits
  for the token after the sampled one, i.e. the first draft of the next step. A verify row's
  rejected positions get keys from rejected tokens; the next step's passes overwrite each of
  them before any query reads it, since they write position p before attending at p.
- **propose**, before the next verify step's forward pass (``ModelRunner._fill_drafts``):
  draft 1 is drawn from those logits; draft j + 1 from a pass at position ``n + j - 1`` (n:
  the step's first input position) fed draft j and the previous pass's hidden state, with the
  step's block tables (the scheduler gave those positions slots for this step's drafts).

Drafts are drawn from the head's distribution q over its draft vocabulary (argmax for greedy
requests), mapped to target ids on the device, and q, scattered over the target's vocabulary
(zero elsewhere), goes to the rejection sampler: the output is distributed as the target's
whatever the head proposes.

What the head's pool does not follow, as for the draft model: swaps and the offloading tier's
moves, and a prefix-cache hit's last cached position (its keys were written with the next
token of the sequence that computed it). Such keys are stale, never uninitialised (the pool
starts zeroed): they cost acceptance, not correctness. A sequence with no state from the
previous step (a new beam, say) gets drafts from zero logits for that step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.models.eagle3 import Eagle3Head
from pagedserve.platforms.interface import ChainGraphRunner, Platform
from pagedserve.sample.metadata import to_device
from pagedserve.worker.drafter import DeviceDrafts, copy_blocks, draw
from pagedserve.worker.input_batch import HostInputs, ModelInputs, pack_inputs
from pagedserve.worker.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker.sampling_batch import SamplingBatch


class _HeadState(NamedTuple):
    """The head at each sampled sequence's last accepted position of the last step."""

    rows: dict[Sequence, int]  # sequence -> its row below
    hidden: torch.Tensor  # [N, H]: before the final norm (the next pass's hidden input)
    logits: torch.Tensor  # [N, draft_vocab]: for the first draft of the next step


class EagleDrafter:
    def __init__(self, head: Eagle3Head, platform: type[Platform], num_kv_heads: int,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 num_speculative_tokens: int) -> None:
        self.head = head
        self.platform = platform
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.max_model_len = max_model_len
        self.max_drafts = num_speculative_tokens
        self.block_size = 16
        self.kv_cache: KVCache | None = None
        self.graphs: ChainGraphRunner | None = None
        self._state: _HeadState | None = None

    def kv_bytes_per_block(self, spec: KVCacheSpec) -> int:
        return spec.bytes_per_block(self.head.config.arch, self.num_kv_heads)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        """The head's pool: the target's block ids (its pad block included) address it."""
        self.block_size = spec.block_size
        self.kv_cache = KVCache(self.platform, self.head.config.arch, self.num_kv_heads, spec)
        # Keys never written (stale after a swap, say) must still be numbers: a NaN would
        # reach q, which the rejection sampler divides by.
        self.kv_cache.pool.zero_()

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Greedy steps' chained passes in one graph per batch size, where the platform has
        them (``Platform.chain_graphs``)."""
        graphs_cls = self.platform.chain_graphs()
        if graphs_cls is None or self.max_drafts < 2:
            return
        self.graphs = graphs_cls(self.head, self.kv_cache.layers[0], self.dtype, max_num_seqs,
                                 self.max_model_len, self.block_size, self.max_drafts - 1)
        self.graphs.capture()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_blocks(self.platform, self.kv_cache.pool, copies)

    @torch.inference_mode()
    def extend(self, inputs: ModelInputs, host: HostInputs, aux: torch.Tensor,
               scheduled: list[ScheduledSequence], sampled: list[ScheduledSequence],
               token_ids: torch.Tensor | None, num_emitted: torch.Tensor | None) -> None:
        """The head over the step's positions (see the module docstring); ``aux`` is the
        target's auxiliary hidden states of the step, ``token_ids`` ``[len(sampled), W]`` and
        ``num_emitted`` (None: one token per row) what the step sampled."""
        shifted = torch.zeros_like(inputs.input_ids)
        shifted[:-1] = inputs.input_ids[1:]
        ends, following, row = [], [], 0
        for item in scheduled:
            row += item.num_new_tokens
            if not item.num_sample_positions:
                ends.append(row - 1)
                following.append(item.seq.all_token_ids[item.num_computed_tokens
                                                        + item.num_new_tokens])
        if ends:
            shifted[to_device(ends, torch.int64, self.device)] = to_device(
                following, torch.int64, self.device)
        counts = host.sample_counts
        if sampled:
            # Sample position (i, j) of the step's rows is token_ids[i, j].
            width = token_ids.shape[1]
            flat = np.repeat(np.arange(len(counts)) * width, counts) + (
                np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
            shifted[inputs.logits_indices] = token_ids.view(-1)[
                to_device(flat, torch.int64, self.device)].clamp_min(0)
        normed, prenorm = self.head(shifted, inputs.positions, self.head.fuse(aux),
                                    self.kv_cache.layers[0], inputs.ctx)
        if not sampled:
            self._state = None
            return
        first = to_device(host.sample_rows[np.cumsum(counts) - counts], torch.int64,
                          self.device)
        last = first if num_emitted is None else first + num_emitted.to(self.device) - 1
        self._state = _HeadState({s.seq: i for i, s in enumerate(sampled)}, prenorm[last],
                                 self.head.compute_logits(normed[last]))

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSequence], sampling: SamplingBatch
                ) -> DeviceDrafts:
        """Drafts for the items of ``scheduled`` with draft slots."""
        items = [s for s in scheduled if s.draft_token_ids]
        num_drafts = [len(s.draft_token_ids) for s in items]
        meta = sampling.metadata([s.seq for s in items], [1] * len(items))
        logits, hidden = self._first_logits(items)
        to_target = self.head.draft_to_target
        width, device = max(num_drafts), self.device
        if meta.all_greedy and self.graphs is not None and self.graphs.can_run(len(items),
                                                                               width):
            return self._replay(items, num_drafts, to_target[logits.argmax(-1)], hidden)
        tokens = torch.full((len(items), width), -1, dtype=torch.int64, device=device)
        probs = None if meta.all_greedy else torch.zeros(
            (len(items), width, self.head.config.arch.vocab_size), dtype=torch.float32,
            device=device)
        for j in range(width):
            rows = [i for i, d in enumerate(num_drafts) if d > j]
            rows_t = to_device(rows, torch.int64, device)
            if j:
                inputs = self._chain_inputs(items, rows, j, tokens[rows_t, j - 1])
                normed, hidden_rows = self.head(inputs.input_ids, inputs.positions,
                                                hidden[rows_t], self.kv_cache.layers[0],
                                                inputs.ctx)
                hidden[rows_t] = hidden_rows
                logits = self.head.compute_logits(normed)
            drawn, q = draw(logits, meta, rows, rows_t)
            if probs is not None:
                probs[rows_t[:, None], j, to_target] = q
            tokens[rows_t, j] = to_target[drawn]
        flat_index = to_device([i * width + j for i, d in enumerate(num_drafts)
                                for j in range(d)], torch.int64, device)
        if probs is not None:
            probs = probs.view(-1, probs.shape[-1])[flat_index]
        return DeviceDrafts(tokens, probs, flat_index)

    def _replay(self, items: list[ScheduledSequence], num_drafts: list[int],
                first: torch.Tensor, hidden: torch.Tensor) -> DeviceDrafts:
        """A greedy step's drafts through the chain's graph: draft 1 given, 2 .. k drawn."""
        width, device = max(num_drafts), self.device
        tables = np.zeros((len(items), max(len(s.block_ids) for s in items)), dtype=np.int32)
        for i, item in enumerate(items):
            tables[i, :len(item.block_ids)] = item.block_ids
        counts = np.asarray(num_drafts, dtype=np.int64)
        later = self.graphs.run(
            first, hidden, to_device([s.num_computed_tokens for s in items], torch.int64, device),
            torch.from_numpy(counts).to(device, non_blocking=True),
            torch.from_numpy(tables).to(device, non_blocking=True))
        tokens = torch.cat([first[:, None], later[:, :width - 1]], dim=1)
        valid = np.arange(width)[None, :] < counts[:, None]
        tokens = tokens.masked_fill(~torch.from_numpy(valid).to(device, non_blocking=True), -1)
        flat_index = torch.from_numpy(np.flatnonzero(valid)).to(device, non_blocking=True)
        return DeviceDrafts(tokens, None, flat_index)

    def _first_logits(self, items: list[ScheduledSequence]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each item's head logits and hidden state from the last step's extend; zeros for a
        sequence that did not sample in it."""
        state = self._state
        known = [state is not None and item.seq in state.rows for item in items]
        cfg = self.head.config
        if not all(known):
            logits = torch.zeros((len(items), cfg.draft_vocab_size), device=self.device,
                                 dtype=state.logits.dtype if state else torch.float32)
            hidden = torch.zeros((len(items), cfg.arch.hidden_size), device=self.device,
                                 dtype=self.dtype)
            have = [i for i, k in enumerate(known) if k]
            if have:
                rows = to_device(have, torch.int64, self.device)
                src = to_device([state.rows[items[i].seq] for i in have], torch.int64,
                                self.device)
                logits[rows], hidden[rows] = state.logits[src], state.hidden[src]
            return logits, hidden
        src = to_device([state.rows[item.seq] for item in items], torch.int64, self.device)
        return state.logits[src], state.hidden[src]

    def _chain_inputs(self, items: list[ScheduledSequence], rows: list[int], j: int,
                      previous: torch.Tensor) -> ModelInputs:
        """A pass fed draft j (``previous``, one per row of ``rows``) at position
        ``n + j - 1``."""
        chunks = [ScheduledSequence(items[i].seq, items[i].num_computed_tokens + j - 1, 1,
                                    items[i].block_ids, 1) for i in rows]
        # pack_inputs reads a position's token from the host where it has one (the step's
        # first input, for j = 1) and from ``previous`` past it; the pass reads ``previous``.
        sources = {items[i].seq: k for k, i in enumerate(rows)}
        inputs = pack_inputs(SchedulerOutput(chunks), self.block_size, sources).to_device(
            self.device, previous)
        inputs.input_ids = previous
        return inputs
