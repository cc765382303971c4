"""Turns one step's logits into next tokens and their logprobs, all as batched tensor ops.

Order of operations (vLLM's): allowed_token_ids, bad_words, logit_bias, min_tokens, repetition
penalty, presence/frequency penalties, the custom logits processors that may change the argmax
(``--logits-processors``, in the order given), the grammar mask of constrained rows (last, so
that no processor can let through a token the grammar forbids); then the argmax-invariant
custom processors, temperature, top-k, top-p, min-p; then greedy argmax or a random draw.

Logprobs are those of the model's distribution after the first group (allowed ids, bad words,
bias, min_tokens, penalties, processors that may change the argmax, grammar) and before the
argmax-invariant processors, temperature and truncation, which is what vLLM reports by default:
a client sees how likely the model found a token, not an artefact of its sampling knobs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedserve.sample.logits_processor import apply_processors
from pagedserve.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedserve.sample.metadata import BadWords, Penalties, SamplePositions, SamplingMetadata
from pagedserve.structured.grammar_state import GrammarMask


class SamplerOutput(NamedTuple):
    """Per sequence and sample position: row i's first ``counts[i]`` positions are its
    samples (``SamplePositions.counts``; one each where the metadata has no ``positions``),
    the slots after them are padding."""

    token_ids: torch.Tensor  # int64 [N, M]
    # The rest is None when no row needs logprobs (``SamplingMetadata.needs_logprobs``).
    logprobs: torch.Tensor | None  # float32 [N, M]: logprob of the sampled token
    ranks: torch.Tensor | None  # int64 [N, M]: rank of the sampled token (1 = most likely)
    top_ids: torch.Tensor | None  # int64 [N, M, K], K = meta.max_num_logprobs; None if K == 0
    top_logprobs: torch.Tensor | None  # float32 [N, M, K]


class Sampler:
    """Stateless; a class so the model runner can hold and swap it like its other parts."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: [P, V] in the model's dtype, a row per sample position (``meta``'s
        rows); float32 copies are made only where a step edits them, samples at random or
        reports logprobs."""
        return fold_positions(self._sample(logits, meta), meta.positions)

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """A row per position: [P] tokens."""
        if meta.all_greedy and not meta.edits_logits and not meta.needs_logprobs:
            # The argmax of the model's own dtype is the argmax of its float32 values (the
            # cast is exact): no [N, V] float32 copy.
            return SamplerOutput(logits.argmax(dim=-1), None, None, None, None)
        logits = process_logits(logits, meta)
        token_ids = sample(logits, meta)
        if not meta.needs_logprobs:
            return SamplerOutput(token_ids, None, None, None, None)
        return SamplerOutput(token_ids, *compute_logprobs(logits, token_ids, meta.max_num_logprobs))


def fold_positions(out: SamplerOutput, positions: SamplePositions | None) -> SamplerOutput:
    """[P, ...] position rows as [N, M, ...]; one position per row is a view, no copy."""
    if positions is None:
        return SamplerOutput(*(None if t is None else t.unsqueeze(1) for t in out))
    num_rows = len(positions.counts)

    def fold(t: torch.Tensor) -> torch.Tensor:
        rows = t.new_zeros((num_rows * positions.max_positions, *t.shape[1:]))
        return rows.index_copy_(0, positions.slots, t).view(
            num_rows, positions.max_positions, *t.shape[1:])

    return SamplerOutput(*(None if t is None else fold(t) for t in out))


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of the actual next prompt tokens under the raw logits at prompt positions."""
    return compute_logprobs(logits, next_token_ids, k)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 logits after allowed ids, bad words, logit_bias, min_tokens, penalties, the
    custom processors that may change the argmax, and grammar; never edits the input."""
    logits = logits.to(torch.float32, copy=meta.edits_logits)
    if meta.allowed_mask is not None:
        apply_row_mask(logits, *meta.allowed_mask)
    if meta.bad_words is not None:
        apply_bad_words(logits, meta.bad_words)
    if meta.logit_bias is not None:
        rows, token_ids, bias = meta.logit_bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    if meta.min_tokens_mask is not None:
        logits.index_put_(meta.min_tokens_mask, logits.new_tensor(float("-inf")))
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.processors is not None:
        logits = apply_processors(logits, meta.processors.changing, meta.processors.rows)
    if meta.grammar_mask is not None:
        apply_grammar_mask(logits, meta.grammar_mask)
    return logits


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Set to -inf, in place, the tokens the grammar forbids in the constrained rows only."""
    bits = 1 << torch.arange(32, dtype=torch.int32, device=logits.device)  # 1 << 31 wraps: ok
    # Bit b of word w is token 32 w + b; the last word's spare bits fall past the vocabulary.
    forbidden = (mask.bitmask.unsqueeze(-1) & bits) == 0
    apply_row_mask(logits, mask.rows, forbidden.flatten(1)[:, :logits.shape[-1]])


def apply_row_mask(logits: torch.Tensor, rows: torch.Tensor, forbidden: torch.Tensor) -> None:
    """Set to -inf, in place, the tokens ``forbidden`` (bool [R, V]) marks in ``rows`` only."""
    selected = logits.index_select(0, rows)
    selected.masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, rows, selected)


def apply_bad_words(logits: torch.Tensor, bad: BadWords) -> None:
    """Set to -inf, in place, each word's last token where its row's output ends with the
    rest of the word. Adding 0 or -inf, accumulated, is right whatever the order of words
    that share a token (a plain write of the two would race)."""
    recent = bad.history.index_select(0, bad.word_rows)
    ends_with = ((recent == bad.prefixes) | (bad.prefixes < 0)).all(dim=1)
    ban = torch.where(ends_with, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((bad.rows[bad.word_rows], bad.last), ban, accumulate=True)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    counts = p.output_counts
    if p.prompt_mask is not None:
        # HF: shrink a seen token's logit towards "less likely" whatever its sign.
        seen = p.prompt_mask | (counts > 0)
        penalised = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
        logits = torch.where(seen, penalised, logits)
    return logits - (counts * p.frequency + (counts > 0) * p.presence)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """int64 [N] next tokens; greedy rows take the argmax, which top_k=1 reproduces exactly."""
    greedy = logits.argmax(dim=-1) if meta.greedy is not None else None
    if meta.all_greedy:
        return greedy
    sampled = exponential_race(sampling_probs(logits, meta), meta.generators)
    return sampled if greedy is None else torch.where(meta.greedy, greedy, sampled)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 [N, V]: the distribution random rows draw from, after the argmax-invariant custom
    processors, temperature, top-k, top-p and min-p (greedy rows get their untempered softmax,
    with those processors). ``logits`` are ``process_logits``'."""
    if meta.processors is not None and meta.processors.invariant:
        # On a copy: the logprobs read `logits` as they are.
        logits = apply_processors(logits.clone(), meta.processors.invariant,
                                  meta.processors.rows)
    # Division makes a fresh tensor, so truncation may mask in place without touching `logits`,
    # which the logprobs still need.
    return truncate(logits / meta.temperature, meta).softmax(dim=-1)


def truncate(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set to -inf, in place, the tokens outside each row's top-k, top-p nucleus and min-p."""
    if meta.top_p is not None:
        logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        _top_k(logits, meta.top_k, meta.max_top_k)
    if meta.min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); no softmax needed, and
        # min_p = 0 gives a -inf floor that masks nothing.
        floor = logits.amax(dim=-1, keepdim=True) + meta.min_p.log().unsqueeze(1)
        logits.masked_fill_(logits < floor, float("-inf"))
    return logits


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k alone needs only the k largest values, not a full sort."""
    kth = logits.topk(max_top_k, dim=-1).values.gather(
        1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_((top_k > max_top_k).unsqueeze(1), float("-inf"))  # rows without top-k
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """One ascending sort serves both; top-p acts on the distribution renormalised after
    top-k. Keeps the smallest set of most likely tokens whose mass reaches p."""
    sorted_logits, order = logits.sort(dim=-1)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Ascending cumulative mass <= 1 - p marks exactly the tail outside the nucleus; the most
    # likely token always survives, even when rounding pushes the sum past the threshold.
    tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = tail_mass <= 1 - top_p.unsqueeze(1)
    outside[:, -1] = False
    sorted_logits.masked_fill_(outside, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw from each row of ``probs`` as argmax(p / q), q ~ Exp(1): the same distribution as
    multinomial, but without a device sync.

    A seeded row draws its own [V] noise from its request's generator, so its token depends only
    on its own probabilities and generator state, not on the batch around it. The other rows
    share one draw from the default generator.
    """
    return probs.div_(exponential_noise(probs, generators)).argmax(dim=-1)


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]
                      ) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``: each seeded row from its generator, the other rows
    from one draw of the default generator; never 0."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # A zero draw would make a masked token's 0/0 = NaN, which argmax picks over everything.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)
