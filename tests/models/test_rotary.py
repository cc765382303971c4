"""Phi-3 longrope's two frequency sets: the cos/sin table against an independent float64
computation, and the engine against transformers in float64 on a tiny Phi-3 whose
original_max_position_embeddings is 64 (of 256): a prompt longer than that (long factors at
every position, as transformers' one forward of it), a shorter one whose generation crosses
it (short factors within, long beyond, as transformers' decode steps on their cache), and KV
blocks that the two kinds of sequence never share."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.rotary import RotaryEmbedding
from tests.tiny_models import (
    ARCH_CONFIGS,
    VOCAB,
    assert_greedy_matches,
    decode_logprob_error,
    hf_model_float64,
    make_llm,
    prompt_logprob_error,
    random_prompts,
    write_tiny_model,
)

ORIGINAL, LONGEST = 64, 256
OVERRIDES = dict(original_max_position_embeddings=ORIGINAL, max_position_embeddings=LONGEST)


def _scaling(**extra) -> dict:
    cfg = {**ARCH_CONFIGS["phi3-longrope"], "vocab_size": VOCAB, **OVERRIDES}
    return {**ModelArchConfig.from_hf_dict(cfg).rope_scaling, **extra}


def _expected_angles(scaling: dict, head_dim: int) -> torch.Tensor:
    """Rows 0 to 255 by position (short factors below 64, long from 64), then positions 0
    to 63 by the long factors, in float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    short, long = (1.0 / (torch.tensor(scaling[f], dtype=torch.float64) * 10000.0 ** exponents)
                   for f in ("short_factor", "long_factor"))
    positions = torch.arange(LONGEST, dtype=torch.float64)[:, None]
    by_position = torch.where(positions < ORIGINAL, positions * short, positions * long)
    return torch.cat((by_position, positions[:ORIGINAL] * long))


def test_longrope_table_against_float64():
    scaling = _scaling()
    rope = RotaryEmbedding(16, LONGEST, 10000.0, scaling, LayerOps)
    angles = _expected_angles(scaling, 16)
    mscale = math.sqrt(1 + math.log(LONGEST / ORIGINAL) / math.log(ORIGINAL))  # 4x longer
    assert rope.cos.shape == rope.sin.shape == (LONGEST + ORIGINAL, 8)
    torch.testing.assert_close(rope.cos.double(), angles.cos() * mscale, atol=1e-4, rtol=0)
    torch.testing.assert_close(rope.sin.double(), angles.sin() * mscale, atol=1e-4, rtol=0)
    given = RotaryEmbedding(16, LONGEST, 10000.0, _scaling(attention_factor=1.5), LayerOps)
    torch.testing.assert_close(given.cos.double(), angles.cos() * 1.5, atol=1e-4, rtol=0)


def test_longrope_rows_of_long_prompt_sequences():
    """Only a long-prompt sequence's positions below the original length move to the long
    factors' extra rows; without longrope the rows are the positions."""
    rope = RotaryEmbedding(16, LONGEST, 10000.0, _scaling(), LayerOps)
    positions = torch.tensor([0, 63, 64, 200] * 2)
    long_rope = torch.tensor([False] * 4 + [True] * 4)
    assert rope.rows(positions, long_rope).tolist() == [0, 63, 64, 200, 256, 319, 64, 200]
    assert rope.rows(positions, None).tolist() == positions.tolist()
    plain = RotaryEmbedding(16, LONGEST, 10000.0, None, LayerOps)
    assert plain.rows(positions, long_rope).tolist() == positions.tolist()
    assert plain.cos.shape == (LONGEST, 8)


@pytest.fixture(scope="module")
def longrope_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("longrope"), "phi3-longrope", **OVERRIDES)


@pytest.fixture(scope="module")
def hf64(longrope_folder):
    return hf_model_float64(longrope_folder)


def test_prompt_longer_than_the_original_length(longrope_folder, hf64):
    """100 tokens, prefilled in chunks of 24 (one straddling position 64): every position by
    the long factors, as transformers' single forward of the prompt; then greedy tokens as
    its decode steps give them. Read by position alone (the short factors below 64), the
    logprobs are far off."""
    prompt = random_prompts("longrope-long", [100])[0]
    llm = make_llm(longrope_folder, block_size=8, max_num_batched_tokens=24)
    assert llm.engine.max_model_len == LONGEST
    assert prompt_logprob_error(llm, hf64, prompt) < 1e-4
    assert assert_greedy_matches(llm, hf64, [prompt], new_tokens=12) == 1
    by_position = make_llm(longrope_folder, block_size=8, max_num_batched_tokens=24)
    inputs = by_position.engine.inputs
    inputs.limits = dataclasses.replace(inputs.limits, long_rope_after=None)
    assert prompt_logprob_error(by_position, hf64, prompt) > 1e-2


def _decode_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax before each of ``tokens``, the prompt in one forward and then
    one token a forward on its cache: each forward picks its frequency set by its own length,
    the cache keeping the earlier keys as rotated. (``generate`` differs past the original
    length: Phi-3's ``prepare_inputs_for_generation`` drops the cache there and recomputes
    the whole sequence by the long factors.)"""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=hf.config), []
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), cache=cache, use_cache=True).logits
        for token in tokens:
            rows.append(logits[0, -1].double().log_softmax(-1))
            logits = hf(torch.tensor([[token]]), cache=cache, use_cache=True).logits
    return torch.stack(rows)


def test_prompt_shorter_than_the_original_length(longrope_folder, hf64):
    """40 tokens: the short factors, as transformers' forward of them; then 40 greedy tokens
    cross position 64, each past it rotated by the long factors while the earlier keys stay
    as the short factors rotated them: transformers' decode steps on its cache."""
    prompt = random_prompts("longrope-short", [40])[0]
    llm = make_llm(longrope_folder, block_size=8, max_num_batched_tokens=24)
    assert prompt_logprob_error(llm, hf64, prompt) < 1e-4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    reference = _decode_logprobs(hf64, prompt, out.token_ids)
    assert out.token_ids == reference.argmax(-1).tolist()
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        assert logprobs[token].logprob == pytest.approx(reference[step, token].item(), abs=1e-4)


def test_long_and_short_prompts_never_share_kv_blocks(longrope_folder, hf64):
    """A short prompt's blocks are cached; a long prompt starting with its tokens rotates them
    by the long factors, so it must not reuse them (and stays equal to transformers), while a
    second long prompt does reuse the first's."""
    short = random_prompts("longrope-prefix", [48])[0]
    first, second = (short + tail for tail in random_prompts("longrope-tails", [52, 60]))
    llm = make_llm(longrope_folder, block_size=8, max_num_batched_tokens=24)
    stats = llm.engine.kv.prefix_stats
    assert decode_logprob_error(llm, hf64, short, 4) < 1e-4
    assert decode_logprob_error(llm, hf64, first, 4) < 1e-4
    assert stats.hit_tokens == 0
    assert decode_logprob_error(llm, hf64, second, 4) < 1e-4
    assert stats.hit_tokens >= 40
