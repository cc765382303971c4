"""The driver's sampling rows, kept across steps (the sampling part of vLLM V1's persistent batch).

A sequence gets a row the first time it samples: its settings go into per-row tensors on the
device, with host flags saying which optional stages a step needs, and a seeded sequence gets
its generator, made once from its stream seed (``Sequence.seed``); one with allowed_token_ids
gets its mask, made once too. A step's
``SamplingMetadata`` is gathered from the rows by index (one ``index_select`` per field it
needs), with no per-row work for rows that did not change.

A row stays while its sequence lives: a preempted sequence keeps its row and generator, so
its draws go on where they stopped (a generator made again from the seed would replay its
first draws). Rows of finished sequences are taken back when no row is free, so finishing
costs nothing per step; a finished sequence that a step scheduled before it finished still
samples keeps its row for that step.

Custom logits processors (``sample/logits_processor.py``) keep their own per-row state: they are
told when a row is added (with its params) and removed, here, and ``edited`` records which
rows each one edits, so a step runs only the processors some of its rows need.

Rebuilt every step instead, from the sequences: the penalty histories, the bad words' recent
tokens and min_tokens' stop masks (they change with every token) and logit_bias (rare). Grammar
masks and the beams' top-k width come from the engine (``SamplingInputs``), which holds the
matchers and beams. The next issues' per-row state belongs here too, as more row fields: the
adapter slot (LoRA) and the draft tokens (speculative decoding).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagedserve.core.sequence import Sequence
from pagedserve.sample.logits_processor import LogitsProcessor, StepProcessors
from pagedserve.sample.metadata import (
    SamplePositions,
    SamplingMetadata,
    allowed_mask_row,
    build_bad_words,
    build_logit_bias,
    build_min_tokens_mask,
    build_penalties,
    to_device,
)
from pagedserve.sampling_params import SamplingParams

# Per-row device tensors, gathered into a step's metadata (neutral values as in
# ``SamplingMetadata``: greedy rows hold temperature 1, rows without top-k hold V).
_DEVICE_FIELDS = {"greedy": torch.bool, "temperature": torch.float32, "top_k": torch.int64,
                  "top_p": torch.float32, "min_p": torch.float32}
# Per-row host flags: which stages a step needs, decided without touching the device.
_HOST_FIELDS = {"greedy": np.bool_, "seeded": np.bool_, "top_k": np.int64, "uses_top_k": np.bool_,
                "uses_top_p": np.bool_, "uses_min_p": np.bool_, "logprobs": np.int64,
                "needs_logprobs": np.bool_, "logit_bias": np.bool_, "min_tokens": np.bool_,
                "penalties": np.bool_, "allowed": np.bool_, "bad_words": np.bool_}


class SamplingBatch:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64,
                 processors: Iterable[LogitsProcessor] = ()) -> None:
        self.vocab_size = vocab_size  # the logits' width
        self.device = device
        self.processors = list(processors)
        self._invariant = [p.is_argmax_invariant() for p in self.processors]
        # bool [capacity, len(processors)]: whether processor k edits row r (its ``add``).
        self._edited = np.zeros((0, len(self.processors)), np.bool_)
        self.rows: dict[Sequence, int] = {}
        self.generators: list[torch.Generator | None] = []  # by row
        self._free: list[int] = []  # popped from the end: lowest rows first
        self._host = {name: np.zeros(0, dtype) for name, dtype in _HOST_FIELDS.items()}
        self._device = {name: torch.zeros(0, dtype=dtype, device=device)
                        for name, dtype in _DEVICE_FIELDS.items()}
        # bool [capacity, V], True where a row's allowed_token_ids forbid a token; made when
        # the first sequence with them arrives (capacity x V bytes).
        self._allowed: torch.Tensor | None = None
        self._grow(capacity)

    def metadata(self, seqs: list[Sequence], num_positions: list[int]) -> SamplingMetadata:
        """The metadata of a step where ``seqs[i]`` samples at ``num_positions[i]`` positions,
        equal to the row-by-row build of the same sequences
        (``tests/sample/reference_metadata.py``)."""
        positions = SamplePositions.of(num_positions, self.device)
        slots = np.asarray(self._rows_of(seqs), dtype=np.int64)
        rows = slots if positions is None else np.repeat(slots, positions.counts)
        host = {name: values[rows] for name, values in self._host.items()}
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)

        def gather(name: str, when: bool) -> torch.Tensor | None:
            return self._device[name].index_select(0, index) if when else None

        greedy, random = host["greedy"], ~host["greedy"]
        top_ks = host["top_k"][random & host["uses_top_k"]]
        temperature = gather("temperature", bool(random.any()))
        return SamplingMetadata(
            all_greedy=bool(greedy.all()),
            greedy=gather("greedy", bool(greedy.any())),
            temperature=None if temperature is None else temperature.unsqueeze(1),
            top_k=gather("top_k", len(top_ks) > 0),
            max_top_k=int(top_ks.max(initial=0)),
            top_p=gather("top_p", bool((random & host["uses_top_p"]).any())),
            min_p=gather("min_p", bool((random & host["uses_min_p"]).any())),
            generators={int(row): self.generators[rows[row]]
                        for row in np.flatnonzero(random & host["seeded"])},
            max_num_logprobs=int(host["logprobs"].max(initial=0)),
            needs_logprobs=bool(host["needs_logprobs"].any()),
            allowed_mask=self._allowed_mask(host["allowed"], index),
            **self._rebuilt(seqs, positions, host),
            positions=positions,
            processors=self._step_processors(rows, index),
        )

    def _step_processors(self, rows: np.ndarray, index: torch.Tensor) -> StepProcessors | None:
        """The processors that edit some row of the step (``rows``: each logits row's batch
        row, ``index`` the same on the device)."""
        if not self.processors:
            return None
        used = list(zip(self.processors, self._invariant, self._edited[rows].any(axis=0),
                        strict=True))
        if not any(edits for _, _, edits in used):
            return None
        return StepProcessors([p for p, inv, edits in used if edits and not inv],
                              [p for p, inv, edits in used if edits and inv], index)

    def _allowed_mask(self, allowed: np.ndarray, index: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows with allowed_token_ids and their masks, gathered (``index``: each row's
        slot)."""
        if not allowed.any():
            return None
        rows = torch.from_numpy(np.flatnonzero(allowed)).to(self.device, non_blocking=True)
        return rows, self._allowed.index_select(0, index[rows])

    def _rebuilt(self, seqs: list[Sequence], positions: SamplePositions | None,
                 host: dict[str, np.ndarray]) -> dict:
        """The fields built from the sequences' params and tokens, only where a row uses them
        (one row per position, penalties per sequence, as the reference build in the tests)."""
        counts = positions.counts if positions is not None else [1] * len(seqs)

        def per_row(values: list) -> list:
            return values if positions is None else [
                v for v, c in zip(values, counts, strict=True) for _ in range(c)]

        fields = dict(bad_words=None, logit_bias=None, min_tokens_mask=None, penalties=None)
        if not any(host[name].any()
                   for name in ("bad_words", "logit_bias", "min_tokens", "penalties")):
            return fields
        params = [seq.params for seq in seqs]
        if host["bad_words"].any():
            fields["bad_words"] = build_bad_words(
                per_row(params), per_row([seq.output_token_ids for seq in seqs]), self.device)
        if host["logit_bias"].any():
            fields["logit_bias"] = build_logit_bias(per_row(params), self.device)
        if host["min_tokens"].any():
            # Every sequence of an engine carries its model's EOS ids.
            fields["min_tokens_mask"] = build_min_tokens_mask(
                per_row(params), [seq.num_output_tokens + j for seq, c in zip(seqs, counts)
                                  for j in range(c)],
                sorted(seqs[0].eos_token_ids), self.device)
        if host["penalties"].any():
            penalties = build_penalties(params, [seq.prompt_token_ids for seq in seqs],
                                        [seq.output_token_ids for seq in seqs],
                                        self.vocab_size, self.device)
            if positions is not None:
                penalties = penalties.repeat_rows(
                    to_device(counts, torch.int64, self.device), len(host["greedy"]))
            fields["penalties"] = penalties
        return fields

    def _rows_of(self, seqs: list[Sequence]) -> list[int]:
        try:
            return list(map(self.rows.__getitem__, seqs))
        except KeyError:
            self._add([seq for seq in seqs if seq not in self.rows], seqs)
            return [self.rows[seq] for seq in seqs]

    def _add(self, new: list[Sequence], step: list[Sequence]) -> None:
        """Rows for sequences sampling for the first time; ``step`` holds this step's."""
        if len(self._free) < len(new):
            self._reclaim(set(step))
        if len(self._free) < len(new):
            capacity = len(self.generators)
            self._grow(max(2 * capacity, capacity + len(new) - len(self._free)))
        rows = []
        for seq in new:
            # Each row is taken as its sequence gets it: a processor's ``add`` that raises
            # fails the step, and a row taken for a later sequence would be lost for good.
            row = self.rows[seq] = self._free.pop()
            rows.append(row)
            self.generators[row] = None if seq.seed is None else \
                torch.Generator(device=self.device).manual_seed(seq.seed)
            for name, value in self._host_values(seq).items():
                self._host[name][row] = value
            for k, processor in enumerate(self.processors):
                self._edited[row, k] = processor.add(row, seq.params)
        for seq, row in zip(new, rows, strict=True):
            if seq.params.allowed_token_ids is not None:
                self._allowed_rows()[row] = allowed_mask_row(seq.params.allowed_token_ids,
                                                             self.vocab_size, self.device)
        index = to_device(rows, torch.int64, self.device)
        device_values = [self._device_values(seq.params) for seq in new]
        for i, (name, dtype) in enumerate(_DEVICE_FIELDS.items()):
            self._device[name][index] = to_device([v[i] for v in device_values], dtype,
                                                  self.device)

    def _host_values(self, seq: Sequence) -> dict[str, bool | int]:
        p = seq.params
        return dict(
            greedy=p.is_greedy, seeded=seq.seed is not None,
            top_k=p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size,
            uses_top_k=0 < p.top_k < self.vocab_size, uses_top_p=p.top_p < 1.0,
            uses_min_p=p.min_p > 0.0, logprobs=p.logprobs or 0,
            needs_logprobs=p.needs_logprobs, logit_bias=bool(p.logit_bias),
            min_tokens=p.min_tokens > 0,
            penalties=(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                       or p.frequency_penalty != 0.0),
            allowed=p.allowed_token_ids is not None, bad_words=bool(p.bad_words_token_ids))

    def _device_values(self, p: SamplingParams) -> tuple:
        """In ``_DEVICE_FIELDS``' order."""
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        return (p.is_greedy, 1.0 if p.is_greedy else p.temperature, top_k, p.top_p, p.min_p)

    def _allowed_rows(self) -> torch.Tensor:
        if self._allowed is None:
            self._allowed = torch.zeros(len(self.generators), self.vocab_size, dtype=torch.bool,
                                        device=self.device)
        return self._allowed

    def _reclaim(self, keep: set[Sequence]) -> None:
        """Free the rows of finished sequences that this step does not sample."""
        for seq, row in list(self.rows.items()):
            if seq.status.finished and seq not in keep:
                del self.rows[seq]
                self.generators[row] = None
                self._free.append(row)
                for processor in self.processors:
                    processor.remove(row)
                self._edited[row] = False

    def _grow(self, capacity: int) -> None:
        old = len(self.generators)
        for name, values in self._host.items():
            self._host[name] = np.concatenate([values, np.zeros(capacity - old, values.dtype)])
        self._edited = np.concatenate(
            [self._edited, np.zeros((capacity - old, len(self.processors)), np.bool_)])
        for name, values in self._device.items():
            self._device[name] = torch.cat([values, values.new_zeros(capacity - old)])
        if self._allowed is not None:
            self._allowed = torch.cat([self._allowed,
                                       self._allowed.new_zeros(capacity - old, self.vocab_size)])
        self.generators.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._free.sort(reverse=True)
