"""Logprob, rank and top-k alternatives of chosen tokens, shared by sampling and prompt logprobs.

Works from one ``logsumexp`` per row instead of a full ``log_softmax``: logprob = logit - lse,
so the [N, V] logprob tensor is never materialised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogprobsTensors(NamedTuple):
    logprobs: torch.Tensor  # float32 [N]: logprob of the chosen token
    ranks: torch.Tensor  # int64 [N]: 1 + number of tokens strictly more likely
    top_ids: torch.Tensor | None  # int64 [N, K], most likely first; None when K == 0
    top_logprobs: torch.Tensor | None  # float32 [N, K]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of ``token_ids`` [N] under ``softmax(logits)`` [N, V], plus the top ``k``."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(1, token_ids.unsqueeze(1))
    # Ties count in the token's favour, so an argmax token always has rank 1.
    ranks = (logits > chosen).sum(dim=-1) + 1
    top_ids = top_logprobs = None
    if k > 0:
        top_values, top_ids = logits.topk(k, dim=-1)
        top_logprobs = top_values - lse
    return LogprobsTensors((chosen - lse).squeeze(1), ranks, top_ids, top_logprobs)
