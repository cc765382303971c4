"""The engine's side of a request: its sequences' detokenizers, seeds and logprobs (the core
holds their tokens and blocks), and how it becomes a ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.beam_search import BeamSearch
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.grammar_state import GrammarState


@dataclass(eq=False)
class SequenceState:
    """One sequence of a request. Beams carry no detokenizer or logprobs: they sample greedily,
    are scored from the sampler's top-k, and are decoded once chosen. A seeded sequence's
    generator lives on rank 0 (``worker.sampling_batch``), made from ``seq.seed``."""

    index: int
    seq: Sequence
    request: RequestState
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None = 0.0  # None where the request needs no logprobs
    grammar: GrammarState | None = None  # set once the request's grammar is compiled
    # What earlier outputs held (characters, tokens): a "delta" output starts past them.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.seq.status.finished

    def completion(self, delta: bool) -> CompletionOutput:
        """Everything so far, or with ``delta`` what is new since the last delta."""
        s = self.seq
        text, tokens = self.detokenizer.text, s.output_token_ids
        chars, num = (self.num_sent_chars, self.num_sent_tokens) if delta else (0, 0)
        if delta:
            self.num_sent_chars, self.num_sent_tokens = len(text), len(tokens)
        return CompletionOutput(
            index=self.index,
            text=text[chars:],
            token_ids=tokens[num:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[num:len(tokens)] if self.logprobs is not None else None,
            finish_reason=s.status.finish_reason,
            stop_reason=s.stop_reason,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    group: SequenceGroup
    # The sequences (for beam search: the running beams; none once the search is done).
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    beam: BeamState | None = None
    sent_prompt_logprobs: bool = False  # "delta" outputs carry them once, when complete
    embedding: list[float] | None = None  # a pooling request's, once its prompt is computed

    @property
    def finished(self) -> bool:
        # A loop, not all() over a generator: read for every request every step.
        for s in self.seqs:
            if not s.seq.status.finished:
                return False
        return True

    @property
    def runs_ahead(self) -> bool:
        """Whether the next step may be scheduled before the host has seen the last token:
        not when the next logits read the outputs so far (penalties, min_tokens, bad words of
        more than one token), when the
        host picks the tokens (beam search) or when prompt logprobs are read back as they are
        made. (A grammar's mask is built after the last token is seen: see ``llm_engine``.)"""
        p = self.params
        return not (p.use_beam_search or p.min_tokens or p.prompt_logprobs is not None
                    or p.repetition_penalty != 1.0 or p.presence_penalty
                    or p.frequency_penalty
                    or any(len(word) > 1 for word in p.bad_words_token_ids or ()))

    @property
    def has_sampling_inputs(self) -> bool:
        """Whether its sampling reads what the engine adds (``SamplingInputs``): a grammar's
        mask, or the beams' top-k width."""
        return self.beam is not None or self.params.structured_outputs is not None

    def record_prompt_logprobs(self, first_position: int,
                               entries: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens first_position+1 ...; the first prompt token has none."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        del self.prompt_logprobs[first_position + 1:]
        self.prompt_logprobs.extend(entries)

    def to_output(self) -> RequestOutput:
        finished = self.finished
        delta = self.params.output_kind == "delta"
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._delta_prompt_logprobs() if delta else self.prompt_logprobs,
            outputs=self._completions(finished, delta),
            finished=finished,
            metrics=self.metrics,
            embedding=self.embedding,
        )

    def _delta_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        logprobs = self.prompt_logprobs
        if self.sent_prompt_logprobs or logprobs is None \
                or len(logprobs) < len(self.prompt_token_ids):
            return None
        self.sent_prompt_logprobs = True
        return logprobs

    def _completions(self, finished: bool, delta: bool) -> list[CompletionOutput]:
        if self.beam is not None:
            return list(self.beam.outputs)
        seqs = self.seqs
        if finished and self.params.best_of > self.params.n:
            # best_of: keep the n sequences the model found most likely.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:self.params.n]
        outputs = [s.completion(delta) for s in seqs]
        for i, o in enumerate(outputs):
            o.index = i
        return outputs


@dataclass(eq=False)
class BeamState:
    """A beam-search request's search, the candidates its running beams offered this step
    (kept until every beam has offered), and its outputs once done."""

    search: BeamSearch
    offers: dict[Sequence, tuple[list[int], list[float]]] = field(default_factory=dict)
    outputs: list[CompletionOutput] = field(default_factory=list)


def token_logprobs(sampled: int, logprob: float, rank: int, top_ids: list[int],
                   top_values: list[float], decode) -> TokenLogprobs:
    """The sampled token plus the top-k alternatives, each with its rank."""
    entry = {sampled: Logprob(logprob, rank, decode(sampled))}
    for r, (tok, value) in enumerate(zip(top_ids, top_values), start=1):
        if tok not in entry:
            entry[tok] = Logprob(value, r, decode(tok))
    return entry
