"""The sampling metadata of a step built from plain lists, row by row: the reference the
persistent sampling batch (``worker/sampling_batch.py``) is checked against, and the quick way
for sampler tests to describe a batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.sample.metadata import (
    Penalties,
    SamplePositions,
    SamplingMetadata,
    build_allowed_mask,
    build_bad_words,
    build_logit_bias,
    build_min_tokens_mask,
    build_penalties,
    to_device,
)
from pagedserve.sampling_params import SamplingParams


def build_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
    eos_token_ids: Sequence[int],
    num_positions: list[int] | None = None,
) -> SamplingMetadata:
    """``vocab_size`` is the logits' width (the model's padded vocabulary), not the
    tokenizer's. ``generators[i]`` is row i's request generator (on ``device``) or None.
    Token ids in the params must already be checked (``check_token_ids``, at admission).
    ``num_positions[i]``: the positions sequence i samples at (None: one each); the
    lists are per sequence, the result has a row per position (see the module doc)."""
    positions = SamplePositions.of(num_positions, device) if num_positions else None
    penalties = build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device)
    if positions is None:
        return _build(params, generators, vocab_size, device, eos_token_ids,
                      output_token_ids, [len(out) for out in output_token_ids], penalties)
    # A sequence's rows repeat its settings (and share its generator, which draws for
    # them in order); its penalty counts are built once and repeated on the device.
    seq_of = [i for i, c in enumerate(positions.counts) for _ in range(c)]
    if penalties is not None:
        penalties = penalties.repeat_rows(to_device(positions.counts, torch.int64, device),
                                          len(seq_of))
    meta = _build(
        [params[i] for i in seq_of], [generators[i] for i in seq_of], vocab_size, device,
        eos_token_ids, [output_token_ids[i] for i in seq_of],
        [len(output_token_ids[i]) + j for i, c in enumerate(positions.counts)
         for j in range(c)], penalties)
    meta.positions = positions
    return meta

def _build(params: list[SamplingParams], generators: list[torch.Generator | None],
           vocab_size: int, device: torch.device, eos_token_ids: Sequence[int],
           output_token_ids: list[list[int]], num_output_tokens: list[int],
           penalties: Penalties | None) -> SamplingMetadata:
    greedy = [p.is_greedy for p in params]
    return SamplingMetadata(
        all_greedy=all(greedy),
        greedy=to_device(greedy, torch.bool, device) if any(greedy) else None,
        **_random_sampling(params, greedy, vocab_size, device),
        generators={row: g for row, (g, greedy_row)
                    in enumerate(zip(generators, greedy, strict=True))
                    if g is not None and not greedy_row},
        max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        needs_logprobs=any(p.needs_logprobs for p in params),
        allowed_mask=build_allowed_mask(params, vocab_size, device),
        bad_words=build_bad_words(params, output_token_ids, device),
        logit_bias=build_logit_bias(params, device),
        min_tokens_mask=build_min_tokens_mask(params, num_output_tokens, eos_token_ids, device),
        penalties=penalties,
    )


def _random_sampling(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> dict[str, torch.Tensor | int | None]:
    """Temperature and truncation tensors, each None when no random row uses it. Greedy rows
    get neutral values: SamplingParams already normalised their truncation knobs."""
    random_rows = [p for p, g in zip(params, greedy, strict=True) if not g]
    top_ks = [p.top_k for p in random_rows if 0 < p.top_k < vocab_size]

    def floats(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)

    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    return dict(
        temperature=floats(temperature).unsqueeze(1) if random_rows else None,
        top_k=to_device([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                        torch.int64, device) if top_ks else None,
        max_top_k=max(top_ks, default=0),
        top_p=floats([p.top_p for p in params])
        if any(p.top_p < 1.0 for p in random_rows) else None,
        min_p=floats([p.min_p for p in params])
        if any(p.min_p > 0.0 for p in random_rows) else None,
    )
