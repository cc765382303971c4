"""Beam search as Hugging Face transformers (v5) runs it, on plain numbers.

Each step, every running beam offers its most likely next tokens. Of all (beam, token) pairs
the ``num_candidates`` best by cumulative logprob are kept (twice the width, or more with
several stop tokens, so that enough stay open when the best ones stop). A candidate "stops"
when its token is a stop token or it reaches ``max_tokens``. The best ``width`` open candidates
become the next running beams. Stopped candidates among the best ``width`` become finished
hypotheses scored ``cumulative_logprob / num_tokens ** length_penalty``; the ``width`` best
hypotheses are kept.

The search ends when every candidate stops, when ``early_stopping is True`` and ``width``
hypotheses are finished, or when the best running beam can no longer beat the worst kept
hypothesis: its score is estimated at the current length, or at ``max_tokens`` when
``early_stopping == "never"`` and ``length_penalty > 0``. The estimate is sticky: once no beam
can improve, nothing more is added.
"""

from __future__ import annotations

from typing import NamedTuple


class BeamCandidates(NamedTuple):
    """A running beam after a step: its tokens, score, and its best next tokens."""

    output_token_ids: list[int]
    cumulative_logprob: float
    token_ids: list[int]  # most likely first; at least ``num_candidates`` of them
    logprobs: list[float]


class BeamContinuation(NamedTuple):
    """A running beam of the next step: beam ``parent`` of this step plus ``token_id``."""

    parent: int
    token_id: int
    cumulative_logprob: float


class Hypothesis(NamedTuple):
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    stopped: bool  # ended on a stop token rather than at max_tokens


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, stop_token_ids: frozenset[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * width
        self.finished: list[Hypothesis] = []  # best first, at most ``width``
        self.num_generated = 0
        self.done = False
        self._improvable = True

    def step(self, beams: list[BeamCandidates]) -> list[BeamContinuation]:
        """Choose the next running beams (empty once the search is done)."""
        candidates = self._top_candidates(beams)
        self.num_generated += 1
        stops = [self._stops(c.token_id) for c in candidates]
        running = [c for c, stop in zip(candidates, stops) if not stop][:self.width]
        self._add_finished(beams, candidates[:self.width], stops[:self.width])
        if running:
            self._improvable = self._improvable and self._can_improve(running[0])
        full = len(self.finished) == self.width
        self.done = (not self._improvable or (full and self.early_stopping is True)
                     or all(stops))
        return [] if self.done else running

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

    def _top_candidates(self, beams: list[BeamCandidates]) -> list[BeamContinuation]:
        pairs = [BeamContinuation(i, token, beam.cumulative_logprob + logprob)
                 for i, beam in enumerate(beams)
                 for token, logprob in zip(beam.token_ids[:self.num_candidates],
                                           beam.logprobs[:self.num_candidates])]
        pairs.sort(key=lambda c: -c.cumulative_logprob)
        return pairs[:self.num_candidates]

    def _stops(self, token_id: int) -> bool:
        return token_id in self.stop_token_ids or self.num_generated >= self.max_tokens

    def _add_finished(self, beams: list[BeamCandidates], best: list[BeamContinuation],
                      stops: list[bool]) -> None:
        if not self._improvable or (len(self.finished) == self.width
                                    and self.early_stopping is True):
            return
        for candidate, stop in zip(best, stops):
            if stop:
                tokens = beams[candidate.parent].output_token_ids + [candidate.token_id]
                self.finished.append(Hypothesis(
                    tokens, candidate.cumulative_logprob, self._score(candidate),
                    candidate.token_id in self.stop_token_ids))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def _score(self, candidate: BeamContinuation) -> float:
        return candidate.cumulative_logprob / self.num_generated ** self.length_penalty

    def _can_improve(self, best_running: BeamContinuation) -> bool:
        if len(self.finished) < self.width:
            return True
        length = self.num_generated
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        best_possible = best_running.cumulative_logprob / length ** self.length_penalty
        return best_possible > self.finished[-1].score
