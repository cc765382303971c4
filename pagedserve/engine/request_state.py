"""Per-request bookkeeping above the core: the n (or best_of) token streams of one user
request, or its running beams, with their detokenizers, seeds and logprobs, and how they become
a ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.core.beam_search import BeamSearch, Hypothesis
from pagedserve.core.request import Request
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedserve.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceState:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float = 0.0
    beam_candidates: int = 0  # next tokens a beam offers each step; 0 if not a beam

    @property
    def finished(self) -> bool:
        return self.request.status.finished

    def completion(self) -> CompletionOutput:
        r = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(r.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=r.status.finish_reason,
            stop_reason=r.stop_reason,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    # The streams (for beam search: the running beams; none once the search is done).
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    beam: BeamSearch | None = None
    # Each running beam's (token ids, logprobs) offer, kept until every beam has made one.
    beam_offers: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    beam_outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def record_prompt_logprobs(self, first_position: int,
                               entries: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens first_position+1 ...; the first prompt token has none."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        del self.prompt_logprobs[first_position + 1:]
        self.prompt_logprobs.extend(entries)

    def to_output(self) -> RequestOutput:
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=self._completions(finished),
            finished=finished,
            metrics=self.metrics,
        )

    def _completions(self, finished: bool) -> list[CompletionOutput]:
        if self.beam is not None:
            return list(self.beam_outputs)
        seqs = self.seqs
        if finished and self.params.best_of > self.params.n:
            # best_of: keep the n streams the model found most likely.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:self.params.n]
        outputs = [s.completion() for s in seqs]
        for i, o in enumerate(outputs):
            o.index = i
        return outputs


def beam_completion(index: int, hypothesis: Hypothesis,
                    detokenizer: IncrementalDetokenizer | None) -> CompletionOutput:
    """A finished beam as an output; ``detokenizer`` is fresh for this hypothesis, or None
    for token ids only."""
    if detokenizer is not None:
        for token in hypothesis.token_ids:
            detokenizer.append(token)
        detokenizer.flush()
    return CompletionOutput(
        index=index,
        text=detokenizer.text if detokenizer is not None else "",
        token_ids=list(hypothesis.token_ids),
        cumulative_logprob=hypothesis.cumulative_logprob,
        logprobs=None,
        finish_reason="stop" if hypothesis.stopped else "length",
    )


def token_logprobs(sampled: int, logprob: float, rank: int, top_ids: list[int],
                   top_values: list[float], decode) -> TokenLogprobs:
    """The sampled token plus the top-k alternatives, each with its rank."""
    entry = {sampled: Logprob(logprob, rank, decode(sampled))}
    for r, (tok, value) in enumerate(zip(top_ids, top_values), start=1):
        if tok not in entry:
            entry[tok] = Logprob(value, r, decode(tok))
    return entry
