"""Output processing, the engine's last stage: a computed step's sampled tokens and logprobs
become sequence updates (detokenized text, stop checks, logprob entries, beam choices) and
``RequestOutput``s. It also holds the requests in flight, by id and by sequence."""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedserve.core.sequence import Sequence, SequenceStatus
from pagedserve.engine.beam_driver import BeamDriver
from pagedserve.engine.request_state import RequestState, SequenceState, token_logprobs
from pagedserve.engine.stop_conditions import stop_status, stops_on_token
from pagedserve.logger import get_logger
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.structured.grammar_state import GrammarState
from pagedserve.worker.step import HostSamples, StepOutput, StepResult

logger = get_logger(__name__)

FinishFn = Callable[[Sequence, SequenceStatus], None]
TakeBackFn = Callable[[Sequence, int], None]


class OutputProcessor:
    def __init__(self, finish: FinishFn, take_back: TakeBackFn, beams: BeamDriver) -> None:
        self._finish = finish  # stops a sequence in the core and frees its blocks
        # Returns the slots of a verify step's rejected drafts to the core.
        self._take_back = take_back
        self._beams = beams
        self.requests: dict[str, RequestState] = {}
        self._seqs: dict[Sequence, SequenceState] = {}
        self.num_generation_tokens = 0
        # Requests in flight that need the engine to run one step at a time.
        self.num_step_by_step = 0
        # Requests in flight that sample with the engine's inputs (grammar masks, beams).
        self.num_with_sampling_inputs = 0

    # ---- the requests in flight ---------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self._seqs[seq.seq] = seq
        self.num_step_by_step += not state.runs_ahead
        self.num_with_sampling_inputs += state.has_sampling_inputs

    def pop(self, request_id: str) -> RequestState | None:
        """Forget a request (finished or aborted); its sequences stay in ``state.seqs``."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self._seqs.pop(seq.seq, None)
            self.num_step_by_step -= not state.runs_ahead
            self.num_with_sampling_inputs -= state.has_sampling_inputs
        return state

    def sequence(self, seq: Sequence) -> SequenceState:
        return self._seqs[seq]

    def find(self, seq: Sequence) -> SequenceState | None:
        """The sequence's state, or None once its request is finished and forgotten."""
        return self._seqs.get(seq)

    # ---- a computed step ----------------------------------------------------------------
    def process(self, result: StepResult, output: StepOutput) -> list[RequestOutput]:
        """Apply a step's prompt logprobs and samples (``samples``: on the host); return the
        outputs of the requests it changed, finished ones forgotten."""
        touched = self._apply_prompt_logprobs(output)
        if output.pooled:
            touched |= self._apply_pooled(output.pooled)
        if output.samples is not None:
            touched |= self._apply_samples(result.sampled, result.num_positions,
                                           output.samples)
        return self._outputs(touched)

    def _apply_prompt_logprobs(self, output: StepOutput) -> set[RequestState]:
        touched = set()
        for seq, chunk in output.prompt_logprobs.items():
            state = self._seqs.get(seq)
            if state is None or state.index != 0:
                continue
            # Row i scores the prompt token that follows position first_position + i.
            targets = seq.prompt_token_ids[chunk.first_position + 1:][:len(chunk.logprobs)]
            decode = state.detokenizer.decode_token
            entries = [
                token_logprobs(tok, lp, rank, ids, vals, decode)
                for tok, lp, rank, ids, vals in zip(
                    targets, chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs,
                    strict=True)
            ]
            state.request.record_prompt_logprobs(chunk.first_position, entries)
            touched.add(state.request)
        return touched

    def _apply_pooled(self, pooled: dict[Sequence, list[float]]) -> set[RequestState]:
        """Pooling streams whose prompt is computed: their embedding is their output, and
        they finish (their blocks go back at once)."""
        touched = set()
        for seq, embedding in pooled.items():
            state = self._seqs.get(seq)
            if state is None or state.finished:  # aborted since the step was scheduled
                continue
            state.request.embedding = embedding
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            touched.add(state.request)
        return touched

    def _apply_samples(self, sampled: list[Sequence], num_positions: list[int],
                       rows: HostSamples) -> set[RequestState]:
        touched, beam_requests = set(), set()
        now = time.time()
        for i, (seq, count) in enumerate(zip(sampled, num_positions, strict=True)):
            state = self._seqs.get(seq)
            # A sequence that stopped or was aborted since the step was scheduled: its tokens
            # are dropped.
            if state is None or state.finished:
                continue
            if seq.max_tokens == 0:  # only the prompt was asked for: no token is output
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                touched.add(state.request)
                continue
            if state.request.beam is not None:  # beams sample one position
                self._beams.offer(state, rows.top_ids[i][0], rows.top_logprobs[i][0])
                beam_requests.add(state.request)
                continue
            emitted = count if rows.counts is None else rows.counts[i]
            if emitted == 1:  # a decode step's one token: skip the loop
                self._apply_sample(state, rows, i, 0)
            else:
                self.append_tokens(state, rows, i, emitted)
            if emitted < count and not state.finished:
                self._take_back(seq, count - emitted)  # the rejected drafts' slots
            request = state.request
            _record_token_time(request.metrics, now)
            # A final-only request has no output until its streams are done, and the last
            # to finish does so here: the others need no look at all in ``_outputs``.
            if seq.status.finished or request.params.output_kind != "final_only":
                touched.add(request)
        for request in beam_requests:
            if self._beam_step(request):
                _record_token_time(request.metrics, now)
                touched.add(request)
        return touched

    def append_tokens(self, state: SequenceState, rows: HostSamples, i: int,
                      count: int) -> int:
        """Append row ``i``'s first ``count`` tokens to its sequence one by one, each checked
        for a stop (EOS, stop tokens and strings, max_tokens, min_tokens, the grammar) as if
        it were the only one; the tokens after a stop are dropped. Returns how many were (the
        KV slots they took are the sequence's last ones)."""
        for j in range(count):
            self._apply_sample(state, rows, i, j)
            if state.finished:
                return count - 1 - j
        return 0

    def _apply_sample(self, state: SequenceState, rows: HostSamples, i: int, j: int) -> None:
        seq, token = state.seq, rows.tokens[i][j]
        if state.cumulative_logprob is not None:
            state.cumulative_logprob += rows.logprobs[i][j]
        if state.logprobs is not None:
            k = seq.params.logprobs
            state.logprobs.append(token_logprobs(
                token, rows.logprobs[i][j], rows.ranks[i][j],
                rows.top_ids[i][j][:k] if k else [], rows.top_logprobs[i][j][:k] if k else [],
                state.detokenizer.decode_token))
        state.request.metrics.num_generated_tokens += 1
        seq.append_output(token)
        self.num_generation_tokens += 1
        params = seq.params
        if params.detokenize and (params.include_stop_str_in_output
                                  or not stops_on_token(seq, token)):
            state.detokenizer.append(token)
        status = stop_status(seq, token, state.detokenizer.stop_reason)
        if state.grammar is not None and status is None:
            status = _grammar_status(state.grammar, token)
        elif state.grammar is not None:
            state.grammar.accept(token)  # a stop the grammar may not allow; the stream ends
        if status is not None:
            self._finish(seq, status)
            # The text is final: what the stop-string and UTF-8 hold-backs kept goes out with
            # the output that finishes this stream, not when the request's last one ends.
            state.detokenizer.flush()

    def _beam_step(self, request: RequestState) -> bool:
        """Whether the search finished this step (beams that continue stay silent)."""
        before = request.seqs
        num_tokens, done = self._beams.step(request)
        self.num_generation_tokens += num_tokens
        request.metrics.num_generated_tokens += num_tokens
        for seq in before:
            self._seqs.pop(seq.seq, None)
        for seq in request.seqs:  # the beams that go on, forks among them
            self._seqs[seq.seq] = seq
        return done

    def _outputs(self, touched: set[RequestState]) -> list[RequestOutput]:
        outputs = []
        for state in touched:
            if state.finished:
                for seq in state.seqs:
                    if seq.detokenizer.stop_reason is None:
                        seq.detokenizer.flush()
                self.pop(state.request_id)
                state.metrics.finished_time = time.time()
            elif state.params.output_kind == "final_only":
                continue
            outputs.append(state.to_output())
        return outputs


def _grammar_status(grammar: GrammarState, token: int) -> SequenceStatus | None:
    """Advance ``grammar``; the stream stops once the grammar is complete (or, were the mask
    ever wrong, at a token it refuses, which is logged and never followed)."""
    if not grammar.accept(token):
        logger.error("a sampled token (%d) was outside the grammar; stopping the sequence",
                     token)
        return SequenceStatus.FINISHED_ERROR
    return SequenceStatus.FINISHED_STOPPED if grammar.terminated else None


def _record_token_time(metrics: RequestMetrics, now: float) -> None:
    metrics.first_token_time = metrics.first_token_time or now
    metrics.last_token_time = now
