"""The draft model of speculative decoding (``method: draft_model``), run by the driver inside the
step that verifies its drafts.

The scheduler gives each drafting sequence ``d_i`` draft slots filled with
``DRAFTED_ON_DEVICE`` (the engine's half, ``spec_decode/proposer.py``, only says how many).
Before the target's forward pass, the drafter runs the draft model ``max d_i`` times:

- pass 1 feeds each sequence the tokens its draft cache lacks, up to and including the step's
  first input token (usually that token alone; a whole prompt the first time, split into
  forward passes of at most the step's token budget), and draws draft 1 from the draft's
  distribution after it;
- pass j feeds draft j - 1 to the sequences with ``d_i >= j`` and draws draft j.

Drafts are sampled from the draft's distribution q (its logits at the request's temperature;
argmax for greedy requests) with each seeded request's own generator, and q goes to the
rejection sampler, so the output is distributed exactly as the target's whatever the draft
is (``sample/rejection.py``).

The draft's KV cache uses the target's block tables: it is a second pool of the same block
count (``ModelRunner`` sizes the two together from one budget), so every slot the scheduler
gives a sequence holds the target's keys at a position and the draft's at the same one;
rejected drafts' slots are taken back with the target's. Copy-on-write copies are applied to
both pools. What the draft pool does not follow: swaps and the offloading tier's moves (a
block moved back holds the target's values only). The drafter therefore keeps, per sequence,
how many of its tokens have draft keys written, and trusts nothing else: a sequence it has not
drafted for, or preempted since (swap or recompute), starts again from its first token. A new
sequence thus recomputes its cached prefix in the draft (the draft is the cheap model), and
writes the same values other sequences sharing those blocks already read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.sample.metadata import SamplingMetadata, to_device
from pagedserve.sample.sampler import exponential_race
from pagedserve.worker.input_batch import pack_inputs
from pagedserve.worker.kv_cache import KVCacheSpec
from pagedserve.worker.sampling_batch import SamplingBatch


def copy_blocks(platform, pool: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    src, dst = to_device(copies, torch.int64, pool.device).unbind(1)
    platform.copy_blocks(pool, src, dst)


class DeviceDrafts(NamedTuple):
    """One step's drafts, on the device, for the sequences of the step that have draft slots,
    in scheduling order."""

    token_ids: torch.Tensor  # int64 [R, K]: row i's first d_i drafts, then -1
    probs: torch.Tensor | None  # float32 [sum d_i, V]: q of each draft; None: all greedy
    # int64 [sum d_i]: where each draft is in ``token_ids`` flattened, row by row (built on
    # the host: a mask's nonzero would wait for the device).
    flat_index: torch.Tensor

    @property
    def flat(self) -> torch.Tensor:
        """int64 [sum d_i]: the drafts row by row, the order of their slots in a step."""
        return self.token_ids.view(-1)[self.flat_index]


def draw(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int], rows_t: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from ``logits`` (rows ``rows`` of ``meta``'s, also as ``rows_t`` on the device):
    each row's argmax where it is greedy, else a draw from q, its softmax at the row's
    temperature, with the row's generator where it is seeded; and q (None: all greedy), which
    the rejection sampler reads."""
    drawn = logits.argmax(dim=-1)
    if meta.all_greedy:
        return drawn, None
    q = torch.softmax(logits.float() / meta.temperature[rows_t], dim=-1)
    generators = {k: meta.generators[i] for k, i in enumerate(rows) if i in meta.generators}
    random = exponential_race(q.clone(), generators)
    drawn = random if meta.greedy is None else torch.where(meta.greedy[rows_t], drawn, random)
    return drawn, q


class Drafter:
    def __init__(self, runner, max_pass_tokens: int) -> None:
        # A ModelRunner of the draft checkpoint, its KV pool allocated with the target's block
        # count (its sampler unused: drafts are drawn here).
        self.runner = runner
        # The most tokens a catch-up pass computes (the step's token budget): new sequences
        # catch up whole prompts, and a pass of all of them at once could take any memory.
        self.max_pass_tokens = max_pass_tokens
        # seq -> (tokens whose draft keys are written, the sequence's preemptions then)
        self._written: dict[Sequence, tuple[int, int]] = {}

    def kv_bytes_per_block(self, spec: KVCacheSpec) -> int:
        return spec.bytes_per_block(self.runner.arch, self.runner.num_kv_heads)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> None:
        self.runner.allocate_kv_cache(spec)

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Its passes after the first are decode steps: graphs of the draft model's own."""
        self.runner.capture_graphs(max_num_seqs)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The step's copy-on-write copies (source, destination), in the draft pool too."""
        copy_blocks(self.runner.platform, self.runner.kv_cache.pool, copies)

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSequence], sampling: SamplingBatch
                ) -> DeviceDrafts:
        """Drafts for the items of ``scheduled`` with draft slots (their keys written to the
        draft pool as a side effect)."""
        items = [s for s in scheduled if s.draft_token_ids]
        num_drafts = [len(s.draft_token_ids) for s in items]
        self._forget_finished()
        # How each row samples its drafts: greedy or at its temperature, seeded or not.
        meta = sampling.metadata([s.seq for s in items], [1] * len(items))
        width = max(num_drafts)
        device = self.runner.device
        tokens = torch.full((len(items), width), -1, dtype=torch.int64, device=device)
        probs = None if meta.all_greedy else torch.zeros(
            (len(items), width, self.runner.arch.vocab_size), dtype=torch.float32, device=device)
        for j in range(width):
            rows = [i for i, d in enumerate(num_drafts) if d > j]
            logits = (self._catch_up(items) if j == 0
                      else self._logits(self._next(items, rows, j, tokens[:, j - 1])))
            rows_t = to_device(rows, torch.int64, device)
            drawn, q = draw(logits, meta, rows, rows_t)
            if probs is not None:
                probs[rows_t, j] = q
            tokens[rows_t, j] = drawn
        for item, d in zip(items, num_drafts, strict=True):
            self._written[item.seq] = (item.num_computed_tokens + d, item.seq.num_preemptions)
        flat_index = to_device([i * width + j for i, d in enumerate(num_drafts)
                                for j in range(d)], torch.int64, device)
        if probs is not None:
            probs = probs.view(-1, probs.shape[-1])[flat_index]
        return DeviceDrafts(tokens, probs, flat_index)

    def _catch_up(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """Pass 1: each sequence from its first token without draft keys to the step's first
        input token, in passes of at most ``max_pass_tokens`` tokens (a long catch-up is split
        over consecutive passes); the draft's logits after each sequence's last token."""
        pending = [(i, self._num_written(item.seq, item.num_computed_tokens))
                   for i, item in enumerate(items)]
        logits: list[torch.Tensor | None] = [None] * len(items)
        while pending:
            chunks, done, rest, used = [], [], [], 0
            for i, start in pending:
                item, room = items[i], self.max_pass_tokens - used
                end = item.num_computed_tokens + 1
                if room <= 0:
                    rest.append((i, start))
                    continue
                n = min(end - start, room)
                chunks.append(ScheduledSequence(item.seq, start, n, item.block_ids, 1))
                done.append(i if start + n == end else None)
                if start + n < end:
                    rest.append((i, start + n))
                used += n
            out = self._logits(pack_inputs(SchedulerOutput(chunks), self.runner.block_size)
                               .to_device(self.runner.device))
            for row, i in enumerate(done):
                if i is not None:
                    logits[i] = out[row]
            pending = rest
        return torch.stack(logits)

    def _next(self, items: list[ScheduledSequence], rows: list[int], j: int,
              previous: torch.Tensor):
        """The inputs of the pass drawing draft j + 1 (j >= 1): draft j of each row in
        ``rows`` (``previous[i]``), at its position, j after the step's first input token."""
        chunks, sources = [], {}
        for i in rows:
            item = items[i]
            chunks.append(ScheduledSequence(item.seq, item.num_computed_tokens + j, 1,
                                            item.block_ids, 1))
            sources[item.seq] = i
        # The input token is past the host's tokens: pack_inputs reads it from ``previous``.
        return pack_inputs(SchedulerOutput(chunks), self.runner.block_size, sources).to_device(
            self.runner.device, previous)

    def _logits(self, inputs) -> torch.Tensor:
        hidden = self.runner.run_model(inputs)
        return self.runner.model.compute_logits(hidden[inputs.logits_indices])

    def _num_written(self, seq: Sequence, num_computed: int) -> int:
        written, preemptions = self._written.get(seq, (0, seq.num_preemptions))
        if preemptions != seq.num_preemptions:
            return 0
        return min(written, num_computed)

    def _forget_finished(self) -> None:
        for seq in [s for s in self._written if s.status.finished]:
            del self._written[seq]

