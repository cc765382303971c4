"""One step's sampling settings as batched tensors, built once so the sampler does no per-row work.

Every optional field is ``None`` when no row in the batch needs it, which is how the sampler
skips work: an all-greedy batch without penalties is a single ``argmax``.

Sample positions: a sequence may sample at several positions of a step (the last ``m`` of its
scheduled tokens). The metadata then has one row per position, a sequence's positions
consecutive, each with its sequence's settings; ``positions`` says how they fold back into
``[sequences, max_positions]``. Position ``j`` of a sequence counts ``j`` more output tokens
for min_tokens (the tokens before it are the ones it follows); penalties count the output as of
the step, since the tokens a later position follows are not known to the sampler, and so does
the bad-words match. Verifying drafts, where they are known, adds them
(``Penalties.with_preceding`` and ``BadWords.with_preceding``, called by
``sample/rejection.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from pagedserve.sample.logits_processor import StepProcessors
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.structured.grammar_state import GrammarMask


@dataclass(slots=True)
class Penalties:
    """Repetition (HF style) and presence/frequency (OpenAI style) penalties of a batch.

    Rows without penalties carry neutral values (1, 0, 0), so one batched op serves every row.
    """

    output_counts: torch.Tensor  # int32 [N, V]: occurrences of each token in the row's output
    prompt_mask: torch.Tensor | None  # bool [N, V]: token is in the prompt; None without rep. pen.
    repetition: torch.Tensor  # float32 [N, 1]
    presence: torch.Tensor  # float32 [N, 1]
    frequency: torch.Tensor  # float32 [N, 1]

    def repeat_rows(self, counts: torch.Tensor, total: int) -> Penalties:
        """Row i repeated ``counts[i]`` times (``total`` rows in all, so no device sync)."""
        def rep(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat_interleave(counts, dim=0, output_size=total)

        return Penalties(rep(self.output_counts), rep(self.prompt_mask), rep(self.repetition),
                         rep(self.presence), rep(self.frequency))

    def with_preceding(self, tokens: torch.Tensor, num_preceding: torch.Tensor) -> Penalties:
        """Row p's output also holding the first ``num_preceding[p]`` tokens of ``tokens[p]``
        (int64 [N, K]; ids past them are ignored, -1 included): position j of a verified
        sequence follows its first j drafts, which plain decoding would have counted."""
        take = torch.arange(tokens.shape[1], device=tokens.device) < num_preceding.unsqueeze(1)
        counts = self.output_counts.scatter_add(1, tokens.clamp_min(0), take.to(torch.int32))
        return dataclasses.replace(self, output_counts=counts)


@dataclass(slots=True)
class BadWords:
    """The bad words of the rows that have any, as token sequences: each bans its last token
    in its row where the row's output ends with the tokens before it. K is the longest such
    prefix of the batch; a shorter one is padded on the left with -1, which matches anything
    (so a one-token word, all padding, always matches)."""

    rows: torch.Tensor  # int64 [R]: the rows with bad words
    history: torch.Tensor  # int64 [R, K]: each one's last K output tokens, -1 before its start
    word_rows: torch.Tensor  # int64 [E]: the index in ``rows`` of each word's row
    prefixes: torch.Tensor  # int64 [E, K]: each word but its last token, right-aligned
    last: torch.Tensor  # int64 [E]: the token each word bans

    def with_preceding(self, tokens: torch.Tensor, num_preceding: torch.Tensor) -> BadWords:
        """Row p's output also ending with the first ``num_preceding[p]`` tokens of
        ``tokens[p]`` ([P, D], as ``Penalties.with_preceding``)."""
        width = self.history.shape[1]
        followed = torch.cat([self.history, tokens[self.rows]], dim=1)
        window = torch.arange(width, device=tokens.device) + num_preceding[self.rows].unsqueeze(1)
        return dataclasses.replace(self, history=followed.gather(1, window))


class SamplePositions(NamedTuple):
    """How the P position rows of a batch fold into ``[num_rows, max_positions]``: row ``p`` is
    slot ``slots[p]`` of the flattened fold (sequence ``i``'s positions fill the first
    ``counts[i]`` slots of its row; the rest are padding)."""

    counts: list[int]  # positions of each sequence, in row order (each at least 1)
    max_positions: int
    slots: torch.Tensor  # int64 [P], on the device

    @classmethod
    def of(cls, counts: list[int], device: torch.device) -> SamplePositions | None:
        """None when every sequence samples once: the rows are then the sequences."""
        if all(c == 1 for c in counts):
            return None
        width = max(counts)
        slots = [i * width + j for i, c in enumerate(counts) for j in range(c)]
        return cls(list(counts), width, to_device(slots, torch.int64, device))


@dataclass(slots=True)
class SamplingMetadata:
    """Tensors for one step's batch of N rows, one row per sample position (one per sequence
    that samples this step, unless ``positions`` says otherwise)."""

    all_greedy: bool
    greedy: torch.Tensor | None  # bool [N]; None when no row is greedy
    temperature: torch.Tensor | None  # float32 [N, 1]; greedy rows hold 1; None if all greedy
    top_k: torch.Tensor | None  # int64 [N]; rows without top-k hold V
    max_top_k: int  # largest top-k of the rows that use one (lets top-k skip the full sort)
    top_p: torch.Tensor | None  # float32 [N]; rows without top-p hold 1
    min_p: torch.Tensor | None  # float32 [N]; rows without min-p hold 0
    generators: dict[int, torch.Generator]  # row -> its request's generator (seeded rows only)
    max_num_logprobs: int  # K of the returned top-k logprobs; 0 when no row asked
    needs_logprobs: bool  # whether any row needs its sampled token's logprob and rank
    # (rows, bool [R, V]): the rows with allowed_token_ids, True where a token is not allowed.
    allowed_mask: tuple[torch.Tensor, torch.Tensor] | None
    bad_words: BadWords | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, bias)
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to forbid
    penalties: Penalties | None
    # Allowed tokens of the rows with a grammar; set by the engine, which holds the grammars.
    grammar_mask: GrammarMask | None = None
    positions: SamplePositions | None = None  # None: one position per sequence
    # The custom logits processors that edit some row of the step (None: none does).
    processors: StepProcessors | None = None

    @property
    def edits_logits(self) -> bool:
        """Whether allowed ids, bad words, bias, min_tokens, penalties, a custom processor
        that may change the argmax or a grammar change the logits (the sampler then copies)."""
        return (self.allowed_mask is not None or self.bad_words is not None
                or self.logit_bias is not None or self.min_tokens_mask is not None
                or self.penalties is not None or self.grammar_mask is not None
                or (self.processors is not None and bool(self.processors.changing)))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a stream sync (``torch.tensor(..., device=)``
    waits for the device; a non-blocking copy lets the host run ahead of it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids outside the vocabulary; the engine calls this when it admits a
    request, since an out-of-range index in a batched scatter would fail the whole step."""
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or []),
                      ("bad_words", [t for w in params.bad_words_token_ids or [] for t in w])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidSamplingParam(
                name, f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    # More ids than the vocabulary has can only repeat some; it bounds the list's size.
    if len(params.allowed_token_ids or []) > vocab_size:
        raise InvalidSamplingParam("allowed_token_ids", f"allowed_token_ids has "
                                   f"{len(params.allowed_token_ids)} ids, more than the "
                                   f"vocabulary's {vocab_size}")



def check_some_token_allowed(params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
    """Reject allowed_token_ids that the request's own masks empty: every id a one-token bad
    word, or (while min_tokens forbids stopping) every id a stop token. Each logit of the row
    would be -inf, and the sampler would draw token 0 whatever the request allows."""
    if params.allowed_token_ids is None:
        return
    left = set(params.allowed_token_ids).difference(
        w[0] for w in params.bad_words_token_ids or [] if len(w) == 1)
    if not left:
        raise InvalidSamplingParam("bad_words", "bad_words ban every id of allowed_token_ids, "
                                                "which leaves no token to sample")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    if params.min_tokens > 0 and left <= stops:
        raise InvalidSamplingParam(
            "min_tokens", f"min_tokens={params.min_tokens} forbids the stop tokens, and they are "
            "all that allowed_token_ids (less bad_words) leaves: no token to sample")


def allowed_mask_row(allowed_token_ids: list[int], vocab_size: int, device: torch.device
                     ) -> torch.Tensor:
    """bool [V]: True where a token is not allowed."""
    mask = torch.ones(vocab_size, dtype=torch.bool, device=device)
    return mask.index_fill_(0, to_device(allowed_token_ids, torch.int64, device), False)


def build_allowed_mask(params: list[SamplingParams], vocab_size: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows that set allowed_token_ids, with their masks (the persistent batch keeps each
    row's mask instead, made once when the row is added)."""
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    return to_device(rows, torch.int64, device), torch.stack(
        [allowed_mask_row(params[row].allowed_token_ids, vocab_size, device) for row in rows])


def build_bad_words(params: list[SamplingParams], output_token_ids: list[list[int]],
                    device: torch.device) -> BadWords | None:
    """``BadWords`` of the rows whose params have ``bad_words_token_ids``; host work only for
    them, proportional to their words' lengths."""
    rows = [row for row, p in enumerate(params) if p.bad_words_token_ids]
    if not rows:
        return None
    words = [(i, word) for i, row in enumerate(rows) for word in params[row].bad_words_token_ids]
    width = max(len(word) - 1 for _, word in words)

    def right_aligned(tokens: list[int]) -> list[int]:
        return [-1] * (width - len(tokens)) + tokens

    return BadWords(
        rows=to_device(rows, torch.int64, device),
        history=to_device([right_aligned(output_token_ids[row][-width:] if width else [])
                           for row in rows], torch.int64, device).view(len(rows), width),
        word_rows=to_device([i for i, _ in words], torch.int64, device),
        prefixes=to_device([right_aligned(word[:-1]) for _, word in words], torch.int64,
                           device).view(len(words), width),
        last=to_device([word[-1] for _, word in words], torch.int64, device))


def build_logit_bias(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(row, tok, bias) for row, p in enumerate(params)
               for tok, bias in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, toks, biases = zip(*entries, strict=True)
    return (to_device(rows, torch.int64, device), to_device(toks, torch.int64, device),
            to_device(biases, torch.float32, device))


def build_min_tokens_mask(
    params: list[SamplingParams],
    num_output_tokens: list[int],
    eos_token_ids: Sequence[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stop tokens to forbid in rows still short of min_tokens. As in vLLM, ``ignore_eos``
    takes EOS out of the stop set, so it is not masked either."""
    entries = [(row, tok)
               for row, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True))
               if num_out < p.min_tokens
               for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))]
    if not entries:
        return None
    rows, toks = zip(*entries, strict=True)
    return to_device(rows, torch.int64, device), to_device(toks, torch.int64, device)


def build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> Penalties | None:
    uses_rep = [p.repetition_penalty != 1.0 for p in params]
    uses_any = [r or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                for p, r in zip(params, uses_rep, strict=True)]
    if not any(uses_any):
        return None
    # Token lists of rows without penalties are left out: they would only cost Python time.
    outputs = [out if u else [] for out, u in zip(output_token_ids, uses_any, strict=True)]
    prompts = [prompt if r else [] for prompt, r in zip(prompt_token_ids, uses_rep, strict=True)]

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device).unsqueeze(1)

    return Penalties(
        output_counts=token_counts(outputs, vocab_size, device),
        prompt_mask=token_counts(prompts, vocab_size, device) > 0 if any(uses_rep) else None,
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
    )


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 [N, V] occurrence counts: one flat scatter_add, no padding of the ragged lists."""
    lengths = torch.tensor([len(ids) for ids in token_ids])
    flat = to_device(list(chain.from_iterable(token_ids)), torch.int64, device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths).to(device,
                                                                             non_blocking=True)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, rows * vocab_size + flat, torch.ones_like(flat, dtype=torch.int32))
    return counts.view(len(token_ids), vocab_size)
