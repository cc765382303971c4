"""How many drafts a step verifies: as many as raise the expected output tokens per second.

Verifying ``k`` drafts of a sequence costs ``k`` more tokens in the step; it yields
``1 + a + a^2 + ... + a^k`` tokens in expectation, ``a`` the sequence's acceptance rate. The
step's time is modelled as ``t(T, v) = fixed + per_token * T + verify * v`` for a step of
``T`` tokens, ``v`` 1 when it verifies any draft: a verify step also pays for what a decode
step avoids (its attention runs the varlen path rather than the decode kernel, the rejection
sampler runs, the host waits for it). The three are fitted online from the steps the engine
times (least squares with exponential forgetting, so the fit follows the operating point).
Each extra draft j of a sequence adds ``a^j`` expected tokens, a gain that shrinks with j, so
the best choice takes the largest gains first: sort every candidate draft's gain, and keep
the prefix that maximises

    (tokens without drafts + sum of kept gains) / t(T_base + number kept, number kept > 0).

At batch 1 on a memory-bound device ``per_token`` is small next to ``fixed`` and every likely
draft is kept; in a large batch on a compute-bound step each token costs its share and drafts
are dropped down to none, which is plain decoding: speculation never makes a step worse than
the model says plain decoding would be. Acceptance is tracked per sequence (its own verified
drafts, with the rate of its model's sequences, the base model's or its LoRA adapter's, as the
prior for a new one), recency-weighted by steps: text changes (a stream starts quoting its
prompt, or stops), and a rate measured long ago must not keep a sequence from ever being
drafted again. Evidence fades to the uninformed prior of 1/2 in a few tens of steps, so a
sequence whose drafts were dropped is tried again after the engine's longest pause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Exponential forgetting of the step-time fit: about the last 1 / (1 - _FORGET) steps count.
_FORGET = 0.98
# Weight of the batch-wide rate in a sequence's acceptance estimate (in drafts).
_PRIOR_DRAFTS = 4.0
# Acceptance evidence keeps this share of its weight per step: about the last 20 steps count,
# and after speculation's longest pause (64 steps) under 4% of what was seen before it.
_ACCEPTANCE_FORGET = 0.95


@dataclass
class StepTimeModel:
    """``t(T, v) = fixed + per_token * T + verify * v``, by recency-weighted least squares
    over the timed steps' (T, v, seconds)."""

    # Weighted sums of the features' outer products and of features times seconds.
    gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    moments: np.ndarray = field(default_factory=lambda: np.zeros(3))

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        features = np.array([1.0, num_tokens, float(verifies)])
        self.gram = _FORGET * self.gram + np.outer(features, features)
        self.moments = _FORGET * self.moments + features * seconds

    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per_token, verify). Before any step was timed: drafts look free, so they
        are tried; a term the steps seen cannot tell apart from the others (steps of one size
        only, or verify steps only) shares their time (the least-norm fit)."""
        if self.gram[0, 0] == 0:
            return 1.0, 0.0, 0.0
        # Scaled so that the token count's column does not swamp the others.
        scale = np.array([1.0, max(1.0, np.sqrt(self.gram[1, 1] / self.gram[0, 0])), 1.0])
        gram = self.gram / np.outer(scale, scale)
        solution = np.linalg.lstsq(gram, self.moments / scale, rcond=1e-9)[0] / scale
        fixed, per_token, verify = solution
        return max(fixed, 1e-9), max(per_token, 0.0), max(verify, 0.0)


@dataclass
class _Counts:
    """Drafts proposed and accepted, as of step ``step``; they fade by ``_ACCEPTANCE_FORGET``
    per step after it (applied when next read or added to)."""

    proposed: float = 0.0
    accepted: float = 0.0
    step: int = 0

    def at(self, step: int) -> tuple[float, float]:
        fade = _ACCEPTANCE_FORGET ** (step - self.step)
        return self.proposed * fade, self.accepted * fade

    def add(self, step: int, num_proposed: int, num_accepted: int) -> None:
        proposed, accepted = self.at(step)
        self.proposed, self.accepted = proposed + num_proposed, accepted + num_accepted
        self.step = step


@dataclass
class Acceptance:
    """Drafts proposed and accepted, per sequence and over all the sequences of each model the
    target runs: the base model and each LoRA adapter. The drafter has no adapter, so an
    adapter's sequences may reject what the base model's accept; a sequence starts from the
    rate of its own model's. Both fade with the steps (``tick``)."""

    by_model: dict = field(default_factory=dict)  # lora_int_id (None: base) -> _Counts
    by_seq: dict = field(default_factory=dict)  # seq -> _Counts
    step: int = 0

    def tick(self) -> None:
        """One engine step has passed."""
        self.step += 1

    def record(self, seq, num_proposed: int, num_accepted: int) -> None:
        for counts in (self.by_model.setdefault(_model_of(seq), _Counts()),
                       self.by_seq.setdefault(seq, _Counts())):
            counts.add(self.step, num_proposed, num_accepted)

    def rate(self, seq) -> float:
        proposed, accepted = self.by_model.get(_model_of(seq), _Counts()).at(self.step)
        prior = (accepted + 1.0) / (proposed + 2.0)
        proposed, accepted = self.by_seq.get(seq, _Counts()).at(self.step)
        return (accepted + _PRIOR_DRAFTS * prior) / (proposed + _PRIOR_DRAFTS)

    def forget(self, seq) -> None:
        self.by_seq.pop(seq, None)


def _model_of(seq) -> int | None:
    return None if seq.lora_request is None else seq.lora_request.lora_int_id


def choose_num_drafts(rates: np.ndarray, available: np.ndarray, base_tokens: int,
                      base_output: float, fixed: float, per_token: float,
                      verify: float = 0.0) -> np.ndarray:
    """int64 [R]: drafts to verify for each of R sequences with acceptance ``rates`` and
    ``available`` drafts proposed, in a step of ``base_tokens`` tokens otherwise that outputs
    ``base_output`` tokens otherwise (see the module doc)."""
    if len(rates) == 0 or available.sum() == 0:
        return np.zeros(len(rates), dtype=np.int64)
    rows = np.repeat(np.arange(len(rates)), available)
    offsets = np.arange(len(rows)) - np.repeat(np.cumsum(available) - available, available)
    gains = rates[rows] ** (offsets + 1)  # draft j (0-based) of a row adds rate^(j+1)
    order = np.argsort(-gains, kind="stable")
    kept = np.arange(len(order) + 1)
    output = base_output + np.concatenate(([0.0], np.cumsum(gains[order])))
    rate = output / (fixed + per_token * (base_tokens + kept) + verify * (kept > 0))
    best = int(np.argmax(rate))  # the first maximum: no draft that does not pay
    return np.bincount(rows[order[:best]], minlength=len(rates)).astype(np.int64)
