"""Beam search as a driver over the core: each step every running beam offers its best next
tokens (the sampler's top-k); once all have, ``core.beam_search`` picks the next beams and the
driver turns them into sequences, forking and dropping through the scheduler."""

from __future__ import annotations

from pagedserve.core.beam_search import BeamCandidates, BeamContinuation, Hypothesis
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.sequence import Sequence, SequenceStatus
from pagedserve.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from pagedserve.engine.request_state import RequestState, SequenceState
from pagedserve.outputs import CompletionOutput


class BeamDriver:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer

    def offer(self, seq: SequenceState, top_ids: list[int], top_logprobs: list[float]) -> None:
        seq.request.beam.offers[seq.seq] = (top_ids, top_logprobs)

    def step(self, state: RequestState) -> tuple[int, bool]:
        """Choose the next beams once every running beam has offered. Returns the tokens
        generated (one per beam that offered) and whether the search is done, its outputs
        then in ``state.beam.outputs``."""
        beam = state.beam
        if any(s.seq not in beam.offers for s in state.seqs):
            return 0, False
        candidates = [BeamCandidates(s.seq.output_token_ids, s.cumulative_logprob,
                                     *beam.offers.pop(s.seq)) for s in state.seqs]
        continuations = beam.search.step(candidates)
        if beam.search.done:
            self._finish(state)
        else:
            self._rebuild(state, continuations)
        return len(candidates), beam.search.done

    def _rebuild(self, state: RequestState, continuations: list[BeamContinuation]) -> None:
        """Turn this step's beams into the next: a beam chosen once continues in place, one
        chosen again forks (sharing all its blocks), one not chosen is dropped (freeing its
        own)."""
        old = state.seqs
        chosen: list[SequenceState] = []
        for c in continuations:
            parent = old[c.parent]
            chosen.append(self._fork(parent) if parent in chosen else parent)
        for seq in old:
            if seq not in chosen:
                self.scheduler.finish(seq.seq, SequenceStatus.FINISHED_ABORTED)
        for seq, c in zip(chosen, continuations):
            seq.seq.append_output(c.token_id)
            seq.cumulative_logprob = c.cumulative_logprob
        state.seqs = chosen

    def _fork(self, parent: SequenceState) -> SequenceState:
        child: Sequence = self.scheduler.fork(parent.seq)
        return SequenceState(parent.index, child, parent.request, None, None)

    def _finish(self, state: RequestState) -> None:
        for seq in state.seqs:
            self.scheduler.finish(seq.seq, SequenceStatus.FINISHED_STOPPED)
        state.seqs = []
        state.beam.offers.clear()
        state.beam.outputs = [self._completion(state, i, hypothesis) for i, hypothesis
                              in enumerate(state.beam.search.best(state.params.n))]

    def _completion(self, state: RequestState, index: int,
                    hypothesis: Hypothesis) -> CompletionOutput:
        """A finished beam as an output, decoded now unless the request wants ids only."""
        text = ""
        if state.params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                                 state.params)
            tokens = hypothesis.token_ids
            if hypothesis.stopped and not state.params.include_stop_str_in_output:
                tokens = tokens[:-1]  # a stop token's text is left out, as when sampling
            for token in tokens:
                detokenizer.append(token)
            detokenizer.flush()
            text = detokenizer.text
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(hypothesis.token_ids),
            cumulative_logprob=hypothesis.cumulative_logprob,
            logprobs=None,
            finish_reason="stop" if hypothesis.stopped else "length",
        )
