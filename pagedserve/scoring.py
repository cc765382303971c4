"""vLLM's scoring of text pairs with an embedding model (``LLM.score``, ``/v1/score``,
``/v1/rerank``): which texts are paired, and the score of a pair, the cosine similarity of
their embeddings. With a cross-encoder (a sequence classifier of one label) a pair is one
prompt instead, the tokenizer's pair encoding of the two texts, and its score the classifier's
probability.

The cosine is computed in float64 whether or not the pooler normalized the embeddings, so a
score is the same under ``--pooler-config '{"normalize": false}'``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The (first, second) index pairs vLLM scores: one first text against each second
    (1:N), or the i-th against the i-th when both have the same count (N:N); ``ValueError``
    for anything else."""
    if num_first == 0 or num_second == 0:
        raise ValueError("at least one text must be given on each side of a score")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"{num_first} first texts against {num_second} second texts: give "
                         "one first text (1:N) or as many as the second texts (N:N)")
    return [(i, i) for i in range(num_first)]


def cross_encoder_prompts(tokenizer: Any, firsts: Sequence[str], seconds: Sequence[str],
                          pairs: list[tuple[int, int]]) -> list[list[int]]:
    """Each pair's two texts as one prompt, as vLLM's cross-encoder scoring joins them: the
    tokenizer's pair encoding (its template's special tokens and separators)."""
    return [list(tokenizer(firsts[i], seconds[j])["input_ids"]) for i, j in pairs]


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """0.0 where either vector is zero (vLLM's cosine divides by the norm clamped above 0)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / norms if norms > 0 else 0.0
