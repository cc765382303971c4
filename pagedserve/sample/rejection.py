"""The lossless rejection sampler of speculative decoding: from a verify step's target logits
and each sequence's drafts, the tokens each sequence keeps.

Layout: sequence i with ``d_i`` drafts samples at ``d_i + 1`` consecutive position rows of the
logits and of ``meta`` (``meta.positions.counts[i] = d_i + 1``; ``positions`` None when no
sequence has drafts). Its row j is the target's prediction after its first j drafts.

The rule (Leviathan et al. 2023; Chen et al. 2023), per sequence from position 0 on:
- the target's distribution p_j is plain decoding's at that position: the same processing
  (allowed ids; bad words matching, and penalties counting, the drafts before j; logit_bias,
  min_tokens, grammar), temperature and truncation (``sampler.process_logits``,
  ``sampler.sampling_probs``);
- a greedy sequence accepts d_j while d_j = argmax p_j;
- a random one accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)), q the proposer's
  distribution; without draft probabilities (n-gram) q_j is a point mass on d_j, so it accepts
  with probability p_j(d_j);
- at the first rejection j it emits one token from normalize(max(0, p_j - q_j)) (the argmax for
  a greedy sequence); when every draft is accepted, a bonus token from the last position's p.
Whatever q is, the emitted tokens are distributed exactly as the target's own samples. Rows
after a sequence's first rejection never affect it.

Randomness: a seeded sequence draws from its own generator only, first its ``d_i`` uniforms,
then one [V] row of Exp(1) noise for the emitted token (the exponential race of
``sampler.exponential_race``). Its tokens thus depend on its own logits, drafts and generator
alone, not on the batch around it; without drafts it draws, and samples, exactly what the plain
sampler does. Unseeded sequences share draws from the default generator.

The penalties and bad words of ``meta`` see each sequence's output as of the step (the multi-
position metadata); this module adds the preceding drafts. Grammar masks, if any, must already
be those of each position after its preceding drafts (the engine holds the matchers).
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import NamedTuple

import torch

from pagedserve.sample.logprobs import compute_logprobs
from pagedserve.sample.metadata import SamplePositions, SamplingMetadata, to_device
from pagedserve.sample.sampler import (
    SamplerOutput,
    exponential_noise,
    fold_positions,
    process_logits,
    sampling_probs,
)


class RejectionOutput(NamedTuple):
    """``sampled`` is [N, M] per sequence, M = ``meta.positions.max_positions`` (1 without
    positions): sequence i's first ``num_emitted[i]`` tokens are its accepted drafts, then one
    token of the target's; -1 after them. Its logprobs, ranks and top-k (when
    ``meta.needs_logprobs``) are those of the emitted tokens under the target's processed logits,
    as the plain sampler reports them; past ``num_emitted`` they mean nothing."""

    sampled: SamplerOutput
    num_emitted: torch.Tensor  # int64 [N], in 1 .. d_i + 1; the accepted drafts are one fewer


class Draws(NamedTuple):
    """A verify step's randomness, drawn before it is used (tests set it)."""

    uniform: torch.Tensor  # float32 [N, M - 1]: acceptance draws; past d_i unused
    exponential: torch.Tensor  # float32 [N, V], positive: the emitted token's noise


class Target(NamedTuple):
    """The target's side of every position row."""

    logits: torch.Tensor  # [P, V]: processed float32 (raw when nothing edits nor reports them)
    probs: torch.Tensor | None  # float32 [P, V], what random rows draw from; None: all greedy
    argmax: torch.Tensor | None  # int64 [P]; None when no row is greedy


class _Layout(NamedTuple):
    """Where each sequence's position rows are, on the host and on the device."""

    num_draft: list[int]  # d_i
    first_rows: list[int]  # the row of each sequence's position 0
    width: int  # M
    num_draft_t: torch.Tensor  # int64 [N]
    first_rows_t: torch.Tensor  # int64 [N]
    slots: torch.Tensor  # int64 [P]: i * M + j of each row

    @classmethod
    def of(cls, positions: SamplePositions | None, num_rows: int, device: torch.device
           ) -> _Layout:
        if positions is None:
            rows = torch.arange(num_rows, device=device)
            return cls([0] * num_rows, list(range(num_rows)), 1, torch.zeros_like(rows), rows,
                       rows)
        num_draft = [c - 1 for c in positions.counts]
        first_rows = [0, *accumulate(positions.counts)][:-1]
        return cls(num_draft, first_rows, positions.max_positions,
                   to_device(num_draft, torch.int64, device),
                   to_device(first_rows, torch.int64, device), positions.slots)

    def rows(self) -> torch.Tensor:
        """int64 [N, M]: the row of each sequence's position j, its last row past its end."""
        j = torch.arange(self.width, device=self.slots.device)
        return self.first_rows_t.unsqueeze(1) + torch.minimum(j, self.num_draft_t.unsqueeze(1))


def rejection_sample(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    draws: Draws | None = None,
) -> RejectionOutput:
    """``logits``: [P, V], a row per position of ``meta`` (see the module doc).
    ``draft_token_ids``: int64 [N, K], K >= M - 1, sequence i's drafts first (padding ignored).
    ``draft_probs``: float32 [sum d_i, V], the proposer's q of each draft position, sequence by
    sequence; None for point masses (n-gram). ``draws``: None draws them (module doc). All on
    the logits' device; no host sync."""
    layout = _Layout.of(meta.positions, logits.shape[0], logits.device)
    drafts = draft_token_ids[:, :layout.width - 1]
    meta = count_preceding_drafts(meta, drafts)
    target = target_distribution(logits, meta)
    if draws is None and target.probs is not None:
        draws = _draw(meta.generators, layout, logits.shape[-1], logits.device)
    greedy = None if meta.greedy is None else meta.greedy[layout.first_rows_t]
    accepted = _num_accepted(target, greedy, layout, drafts, draft_probs, draws)
    last = _emitted_token(target, greedy, layout, drafts, draft_probs, draws, accepted)
    tokens = _emitted_tokens(drafts, accepted, last)
    if not meta.needs_logprobs:
        return RejectionOutput(SamplerOutput(tokens, None, None, None, None), accepted + 1)
    row_tokens = tokens.flatten()[layout.slots].clamp_min(0)
    sampled = fold_positions(
        SamplerOutput(row_tokens, *compute_logprobs(target.logits, row_tokens,
                                                    meta.max_num_logprobs)), meta.positions)
    return RejectionOutput(sampled._replace(token_ids=tokens), accepted + 1)


def target_distribution(logits: torch.Tensor, meta: SamplingMetadata) -> Target:
    """What plain decoding would sample from at each row of ``meta``."""
    if meta.all_greedy and not meta.edits_logits and not meta.needs_logprobs:
        return Target(logits, None, logits.argmax(dim=-1))  # argmax is exact in any dtype
    processed = process_logits(logits, meta)
    probs = None if meta.all_greedy else sampling_probs(processed, meta)
    argmax = None if meta.greedy is None else processed.argmax(dim=-1)
    return Target(processed, probs, argmax)


def _draw(generators: dict[int, torch.Generator], layout: _Layout, vocab_size: int,
         device: torch.device) -> Draws:
    """Each seeded sequence's uniforms, then its noise, from its generator (``generators`` is
    keyed by position row; a sequence's rows share one); the rest from the default one."""
    seeded = {i: generators[row] for i, row in enumerate(layout.first_rows) if row in generators}
    num_seqs = len(layout.first_rows)
    uniform = torch.empty(num_seqs, layout.width - 1, device=device)
    if len(seeded) < num_seqs:
        uniform.uniform_()
    for i, generator in seeded.items():
        uniform[i, :layout.num_draft[i]].uniform_(generator=generator)
    noise = exponential_noise(torch.empty(num_seqs, vocab_size, device=device), seeded)
    return Draws(uniform, noise)


def count_preceding_drafts(meta: SamplingMetadata, draft_token_ids: torch.Tensor
                           ) -> SamplingMetadata:
    """The metadata of plain decoding at each verified position: position j's penalties also
    count its sequence's first j drafts, and its bad words match the output followed by them
    (``draft_token_ids`` [N, K], K >= M - 1)."""
    if meta.positions is None or (meta.penalties is None and meta.bad_words is None):
        return meta
    width = meta.positions.max_positions
    seq, j = meta.positions.slots // width, meta.positions.slots % width
    preceding = draft_token_ids[seq, :width - 1]
    penalties, bad_words = meta.penalties, meta.bad_words
    return dataclasses.replace(
        meta, penalties=None if penalties is None else penalties.with_preceding(preceding, j),
        bad_words=None if bad_words is None else bad_words.with_preceding(preceding, j))


def _num_accepted(target: Target, greedy: torch.Tensor | None, layout: _Layout,
                  drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                  draws: Draws | None) -> torch.Tensor:
    """int64 [N]: how many leading drafts each sequence accepts."""
    if layout.width == 1:
        return torch.zeros_like(layout.num_draft_t)
    rows, ids = layout.rows()[:, :-1], drafts.clamp_min(0)
    if target.probs is not None:
        q = 1.0 if draft_probs is None else draft_probs[_draft_rows(layout, draft_probs), ids]
        # u < p / q, without dividing by a q that may be 0.
        accept = draws.uniform * q < target.probs[rows, ids]
    if target.argmax is not None:
        matches = drafts == target.argmax[rows]
        accept = matches if target.probs is None else torch.where(
            greedy.unsqueeze(1), matches, accept)
    valid = torch.arange(drafts.shape[1], device=drafts.device) < layout.num_draft_t.unsqueeze(1)
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def _draft_rows(layout: _Layout, draft_probs: torch.Tensor) -> torch.Tensor:
    """int64 [N, M - 1]: the ``draft_probs`` row of each sequence's draft j (clamped past d_i,
    where it is unused)."""
    first = layout.num_draft_t.cumsum(0) - layout.num_draft_t
    j = torch.arange(layout.width - 1, device=first.device)
    return (first.unsqueeze(1) + j).clamp_max(draft_probs.shape[0] - 1)


def _emitted_token(target: Target, greedy: torch.Tensor | None, layout: _Layout,
                   drafts: torch.Tensor, draft_probs: torch.Tensor | None, draws: Draws | None,
                   accepted: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the target's token at each sequence's first rejected (or bonus) position."""
    row = layout.first_rows_t + accepted
    greedy_token = None if target.argmax is None else target.argmax[row]
    if target.probs is None:
        return greedy_token
    p = target.probs[row]
    rejected = accepted < layout.num_draft_t
    if layout.width > 1:
        at = accepted.clamp_max(layout.width - 2).unsqueeze(1)
        if draft_probs is None:  # q is a point mass on the rejected draft
            residual = p.scatter(1, drafts.gather(1, at).clamp_min(0), 0.0)
        else:
            q = draft_probs[_draft_rows(layout, draft_probs).gather(1, at).squeeze(1)]
            residual = (p - q).clamp_min_(0.0)
        # max(0, p - q) is all zeros only where p = q, which rounding alone can reject: p then.
        use = rejected & (residual.sum(dim=-1) > 0)
        p = torch.where(use.unsqueeze(1), residual, p)
    # The exponential race needs no normalisation: argmax(r / E) ~ r / sum(r).
    token = p.div_(draws.exponential).argmax(dim=-1)
    return token if greedy is None else torch.where(greedy, greedy_token, token)


def _emitted_tokens(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor
                    ) -> torch.Tensor:
    """int64 [N, M]: the accepted drafts, the target's token, then -1."""
    padded = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)
    j = torch.arange(padded.shape[1], device=padded.device)
    a = accepted.unsqueeze(1)
    return torch.where(j < a, padded, torch.where(j == a, last.unsqueeze(1), -1))
