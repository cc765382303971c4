"""Pooling on the driver: a pooling stream's final hidden states (after the model's final norm)
become its embedding once its prompt is computed.

A prompt may take several steps (chunked prefill). ``LAST`` reads only the prompt's last row,
in its last chunk. ``CLS`` keeps the first chunk's first row, ``MEAN`` a float32 running sum of
every chunk's rows, until the last chunk; a stream that starts again from its first token
(preempted and recomputed) starts them again. Both need every prompt token computed here, so
the engine runs them without prefix caching (``EngineConfig.prefix_caching``). Per step the
work is a few tensor ops over the pooling rows (one gather, one segment sum); the Python
loops run per stream, never per token.

A sequence classifier's pooler has its ``score`` head: the pooled row (LAST unless
``--pooler-config`` says otherwise) goes through it and the model's activation (softmax,
sigmoid, tanh or none, ``ModelArchConfig.classifier_activation``), as vLLM's classify pooler
does, and those label probabilities (the raw logits where the request's ``use_activation`` is
false) are the stream's pooled vector, never normalized.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.core.scheduler import ScheduledSequence
from pagedserve.core.sequence import Sequence
from pagedserve.pooling_params import PoolerConfig


class PoolingChunks(NamedTuple):
    """The step's chunks of pooling streams, in row order (host data)."""

    seqs: list[Sequence]
    starts: np.ndarray  # int64: each chunk's first row in the step's hidden states
    counts: np.ndarray  # int64: its rows
    first: np.ndarray  # bool: the chunk starts at the prompt's first token
    last: np.ndarray  # bool: the chunk ends the prompt


class Pooled(NamedTuple):
    """Streams whose prompt a step finished, and their vectors ([n, hidden], float32). A
    stream that asked for ``dimensions`` has its values past them zeroed (``embeddings``
    drops them)."""

    seqs: list[Sequence]
    vectors: torch.Tensor

    def embeddings(self) -> dict[Sequence, list[float]]:
        """Each stream's embedding on the host, of its ``dimensions`` (None: all)."""
        return {seq: vector[:seq.pooling.dimensions]
                for seq, vector in zip(self.seqs, self.vectors.tolist(), strict=True)}


def pooling_chunks(scheduled: list[ScheduledSequence]) -> PoolingChunks | None:
    """Where the step's pooling streams are; None when it has none."""
    seqs, starts, counts, first, last = [], [], [], [], []
    row = 0
    for item in scheduled:
        seq = item.seq
        if seq.pooling is not None:
            seqs.append(seq)
            starts.append(row)
            counts.append(item.num_new_tokens)
            first.append(item.num_computed_tokens == 0)
            last.append(item.num_computed_tokens + item.num_new_tokens == seq.num_prompt_tokens)
        row += item.num_new_tokens
    if not seqs:
        return None
    return PoolingChunks(seqs, np.asarray(starts, dtype=np.int64),
                         np.asarray(counts, dtype=np.int64), np.asarray(first, dtype=bool),
                         np.asarray(last, dtype=bool))


_ACTIVATIONS = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid,
                "tanh": torch.tanh, "identity": lambda x: x}


class Pooler:
    def __init__(self, config: PoolerConfig, device: torch.device,
                 classifier: torch.nn.Linear | None = None, activation: str = "softmax"
                 ) -> None:
        self.config = config
        self.device = device
        self.classifier = classifier
        self.activation = _ACTIVATIONS[activation]
        # MEAN: each stream's float32 sum of its rows so far; CLS: its first row.
        self._partial: dict[Sequence, torch.Tensor] = {}

    def __call__(self, hidden: torch.Tensor, chunks: PoolingChunks) -> Pooled | None:
        """Pool the step's chunks; the vectors of the streams whose prompt ends here."""
        self._forget_finished()
        kind = self.config.pooling_type
        if kind == "LAST":
            vectors = self._rows(hidden, (chunks.starts + chunks.counts - 1)[chunks.last])
        else:
            rows = self._sums(hidden, chunks) if kind == "MEAN" else self._firsts(hidden, chunks)
            vectors = self._carry(rows, chunks)
        if not len(vectors):
            return None
        seqs = [s for s, last in zip(chunks.seqs, chunks.last, strict=True) if last]
        if self.classifier is not None:
            return Pooled(seqs, self._classified(vectors, seqs))
        return Pooled(seqs, self._normalized(self._truncated(vectors, seqs), seqs))

    def _classified(self, vectors: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Label probabilities (float32) of pooled rows, through the head in its dtype; the
        raw logits for streams that asked ``use_activation=False``."""
        logits = self.classifier(vectors.to(self.classifier.weight.dtype)).float()
        raw = [s.pooling.use_activation is False for s in seqs]
        if not any(raw):
            return self.activation(logits)
        if all(raw):
            return logits
        mask = torch.tensor(raw, device=self.device)
        return torch.where(mask[:, None], logits, self.activation(logits))

    def _rows(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)
        return hidden[index].float()

    def _sums(self, hidden: torch.Tensor, chunks: PoolingChunks) -> torch.Tensor:
        """Each chunk's float32 sum of its rows: one gather and one segment sum."""
        counts = chunks.counts
        offsets = np.cumsum(counts) - counts  # each chunk's place among the gathered rows
        rows = np.arange(int(counts.sum())) + np.repeat(chunks.starts - offsets, counts)
        segments = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(
            self.device, non_blocking=True)
        sums = torch.zeros((len(counts), hidden.shape[-1]), dtype=torch.float32,
                           device=self.device)
        return sums.index_add_(0, segments, self._rows(hidden, rows))

    def _firsts(self, hidden: torch.Tensor, chunks: PoolingChunks) -> torch.Tensor:
        """Each chunk's first row (read only where the chunk starts the prompt)."""
        return self._rows(hidden, chunks.starts)

    def _carry(self, rows: torch.Tensor, chunks: PoolingChunks) -> torch.Tensor:
        """Combine each chunk's value with what earlier chunks of its stream left: MEAN adds
        the running sum, CLS keeps the first chunk's row. Streams that go on keep theirs;
        the finished ones' vectors (MEAN: divided by the prompt's length) are returned."""
        mean = self.config.pooling_type == "MEAN"
        done = []
        for i, seq in enumerate(chunks.seqs):
            value = rows[i]
            if not chunks.first[i]:
                earlier = self._partial.pop(seq)
                value = value + earlier if mean else earlier
            if chunks.last[i]:
                done.append(value / seq.num_prompt_tokens if mean else value)
            else:
                self._partial[seq] = value
        if not done:
            return rows[:0]
        return torch.stack(done)

    def _truncated(self, vectors: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Zero each row past its stream's ``dimensions`` (Matryoshka): the L2 norm is then
        the kept values' alone, so normalizing after this is normalizing the cut vector."""
        width = vectors.shape[-1]
        kept = [s.pooling.dimensions or width for s in seqs]
        if all(k == width for k in kept):
            return vectors
        columns = torch.arange(width, device=self.device)
        return vectors * (columns < torch.tensor(kept, device=self.device)[:, None])

    def _normalized(self, vectors: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        default = self.config.normalize
        wanted = [default if s.pooling.normalize is None else s.pooling.normalize for s in seqs]
        if all(wanted):
            return F.normalize(vectors, p=2, dim=-1)
        if not any(wanted):
            return vectors
        mask = torch.tensor(wanted, device=self.device)
        return torch.where(mask[:, None], F.normalize(vectors, p=2, dim=-1), vectors)

    def _forget_finished(self) -> None:
        """Drop what streams aborted mid-prompt left."""
        for seq in [s for s in self._partial if s.status.finished]:
            del self._partial[seq]
