"""Sampler against float64 per-row references: penalties, truncation masks, logprobs, seeding."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from pagedserve.sample.metadata import check_token_ids
from pagedserve.sample.sampler import (
    Sampler,
    SamplerOutput,
    process_logits,
    prompt_logprobs,
    truncate,
)
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from tests.sample.reference_metadata import build_metadata

CPU = torch.device("cpu")
_sampler = Sampler()


def sampler(logits, meta):
    """One position per row: the sampler's [N, 1, ...] outputs read as [N, ...]."""
    return SamplerOutput(*(None if t is None else t.squeeze(1) for t in _sampler(logits, meta)))


def build(params, *, prompts=None, outputs=None, generators=None, vocab_size, eos=()):
    n = len(params)
    return build_metadata(
        params, prompts or [[]] * n, outputs or [[]] * n, generators or [None] * n,
        vocab_size, CPU, list(eos))


# ---- float64 per-row references ------------------------------------------------------------

def ref_process(logits, params, prompts, outputs, eos):
    """Allowed ids, bad words, bias, min_tokens, repetition, presence/frequency, one row and
    one token at a time."""
    out = logits.double().clone()
    for i, p in enumerate(params):
        row = out[i]
        if p.allowed_token_ids is not None:
            for tok in set(range(len(row))) - set(p.allowed_token_ids):
                row[tok] = -math.inf
        for word in p.bad_words_token_ids or []:
            *prefix, last = word
            if outputs[i][len(outputs[i]) - len(prefix):] == prefix:
                row[last] = -math.inf
        for tok, bias in (p.logit_bias or {}).items():
            row[tok] += bias
        if len(outputs[i]) < p.min_tokens:
            for tok in p.stop_token_ids + ([] if p.ignore_eos else list(eos)):
                row[tok] = -math.inf
        if p.repetition_penalty != 1.0:
            for tok in set(prompts[i]) | set(outputs[i]):
                r = p.repetition_penalty
                row[tok] = row[tok] / r if row[tok] > 0 else row[tok] * r
        for tok, count in Counter(outputs[i]).items():
            row[tok] -= count * p.frequency_penalty + p.presence_penalty
    return out


def ref_allowed(scaled_row, p):
    """Set of token ids that survive top-k, then top-p (renormalised), then min-p."""
    probs = torch.softmax(scaled_row.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if p.top_k > 0:
        order = order[:p.top_k]
    total = sum(probs[t] for t in order)
    kept, mass = [], 0.0
    for t in order:
        if mass >= p.top_p:
            break
        kept.append(t)
        mass += probs[t] / total
    top = probs[order[0]]
    return {t for t in kept if probs[t] >= p.min_p * top}


def random_params(rng, vocab_size, **overrides):
    kw = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([-1, 1, 5, 20]),
        top_p=rng.choice([1.0, 0.3, 0.9]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 0.7, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.4]),
        logit_bias=rng.choice([None, {rng.randrange(vocab_size): rng.uniform(-5, 5)}]),
        logprobs=rng.choice([None, 0, 3, 5]),
        min_tokens=rng.choice([0, 0, 4]),
        max_tokens=None,
        stop_token_ids=rng.choice([[], [rng.randrange(vocab_size)]]),
        ignore_eos=rng.random() < 0.3,
        allowed_token_ids=rng.choice([None, None, rng.sample(range(vocab_size), 8)]),
        bad_words_token_ids=rng.choice([None, None, [[rng.randrange(vocab_size)] * n
                                                     for n in (1, 2, 3)]]),
    )
    kw.update(overrides)
    return SamplingParams(**kw)


def random_batch(seed, n, vocab_size, **overrides):
    rng = random.Random(seed)
    params = [random_params(rng, vocab_size, **overrides) for _ in range(n)]
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randrange(12))] for _ in range(n)]
    outputs = [[rng.randrange(vocab_size) for _ in range(rng.randrange(8))] for _ in range(n)]
    logits = torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    return params, prompts, outputs, logits


# ---- greedy --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_draws_no_randomness(dtype):
    logits = (torch.randn(16, 500, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    meta = build([SamplingParams(temperature=0.0)] * 16, vocab_size=500)
    state = torch.get_rng_state()
    out = sampler(logits, meta)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert meta.temperature is None and meta.penalties is None
    # No row asked for logprobs: none are computed.
    assert out.logprobs is None and out.ranks is None and out.top_ids is None
    with_logprobs = sampler(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 16,
                                          vocab_size=500))
    assert torch.equal(with_logprobs.token_ids, out.token_ids)
    assert torch.equal(with_logprobs.ranks, torch.ones(16, dtype=torch.int64))
    expected = logits.double().log_softmax(-1).amax(-1).float()
    torch.testing.assert_close(with_logprobs.logprobs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("params,needs", [
    (SamplingParams(temperature=0.0), False), (SamplingParams(temperature=0.8), False),
    (SamplingParams(logprobs=0), True), (SamplingParams(n=2, best_of=3), True),
    (SamplingParams(n=2), False),
])
def test_logprobs_only_where_a_row_needs_them(params, needs):
    """Asked for, or to rank best_of sequences: the sampled tokens' logprobs exist (vLLM's
    rule for cumulative_logprob); otherwise the sampler makes no pass for them."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    out = sampler(logits, build([params] * 3, vocab_size=50))
    assert (out.logprobs is not None) == needs and (out.ranks is not None) == needs


def test_top_k_1_equals_greedy_in_a_mixed_batch():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_k=1, top_p=0.9 if i % 2 else 1.0,
                             seed=i if i % 3 == 0 else None) for i in range(64)]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for p in params]
    out = sampler(logits, build(params, generators=gens, vocab_size=1000))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


# ---- seeding -------------------------------------------------------------------------------

def _seeded_run(batch_params, target_index, seed, steps, vocab_size=50):
    """Tokens of row `target_index` over `steps` steps; the request keeps its generator."""
    data_gen = torch.Generator().manual_seed(7)
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for p in batch_params]
    tokens = []
    for _ in range(steps):
        # Same target-row logits in every run; other rows vary with the batch size.
        target_logits = torch.randn(vocab_size, generator=data_gen) * 0.5
        logits = torch.randn(len(batch_params), vocab_size)
        logits[target_index] = target_logits
        out = sampler(logits, build(batch_params, generators=gens, vocab_size=vocab_size))
        tokens.append(int(out.token_ids[target_index]))
    return tokens


@pytest.mark.parametrize("target_kw", [{}, {"top_p": 0.8, "top_k": 30}])
def test_seeded_row_is_independent_of_batch(target_kw):
    target = SamplingParams(temperature=0.9, seed=1234, **target_kw)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=99, top_p=0.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=5, min_p=0.1)]
    alone = _seeded_run([target], 0, 1234, steps=10)
    torch.manual_seed(0)
    in_batch = _seeded_run(others[:3] + [target] + others[3:], 3, 1234, steps=10)
    torch.manual_seed(1)
    # The same seed twice in one batch: each request has its own generator.
    twice = _seeded_run([target, others[0], target], 2, 1234, steps=10)
    assert alone == in_batch == twice
    assert len(set(alone)) > 3  # really random, not a constant
    other_seed = _seeded_run([SamplingParams(temperature=0.9, seed=4321, **target_kw)], 0, 4321,
                             steps=10)
    assert other_seed != alone


# ---- logprobs ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_logprobs_match_float64_reference(seed):
    params, prompts, outputs, logits = random_batch(seed, 12, 64)
    eos = [2]
    out = sampler(logits, build(params, prompts=prompts, outputs=outputs, vocab_size=64, eos=eos))
    ref = torch.log_softmax(ref_process(logits, params, prompts, outputs, eos), dim=-1)
    toks = out.token_ids
    chosen = ref.gather(1, toks.unsqueeze(1)).squeeze(1)
    assert torch.isfinite(chosen).all()  # never samples a masked token
    torch.testing.assert_close(out.logprobs.double(), chosen, atol=1e-5, rtol=0)
    assert torch.equal(out.ranks, (ref > chosen.unsqueeze(1)).sum(dim=-1) + 1)
    k = max(p.logprobs or 0 for p in params)
    assert k > 0 and out.top_ids.shape == (12, k)
    ref_top = ref.topk(k, dim=-1)
    assert torch.equal(out.top_ids, ref_top.indices)
    torch.testing.assert_close(out.top_logprobs.double(), ref_top.values, atol=1e-5, rtol=0)
    for i, p in enumerate(params):  # greedy rows pick the top token of the processed logits
        if p.is_greedy:
            assert int(out.ranks[i]) == 1


def test_prompt_logprobs_match_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 30, generator=gen) * 2
    nxt = torch.randint(0, 30, (10,), generator=gen)
    res = prompt_logprobs(logits.to(torch.bfloat16).float(), nxt, 4)
    ref = torch.log_softmax(logits.to(torch.bfloat16).double(), dim=-1)
    chosen = ref.gather(1, nxt.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(res.logprobs.double(), chosen, atol=1e-5, rtol=0)
    assert torch.equal(res.ranks, (ref > chosen.unsqueeze(1)).sum(dim=-1) + 1)
    assert torch.equal(res.top_ids, ref.topk(4).indices)
    torch.testing.assert_close(res.top_logprobs.double(), ref.topk(4).values, atol=1e-5, rtol=0)
    assert prompt_logprobs(logits, nxt, 0).top_ids is None


# ---- logit processors ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_processing_matches_per_row_reference(seed):
    params, prompts, outputs, logits = random_batch(seed, 10, 40)
    eos = [1, 3]
    meta = build(params, prompts=prompts, outputs=outputs, vocab_size=40, eos=eos)
    before = logits.clone()
    got = process_logits(logits, meta)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    torch.testing.assert_close(got.double(), ref_process(logits, params, prompts, outputs, eos),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_allowed_ids_and_bad_words_match_per_row_reference(seed):
    """Bad words that end where each row's output does (so they ban), that do not (so they
    must not), of one token (always banned) and longer than the output (never)."""
    params, prompts, outputs, logits = random_batch(seed, 8, 40)
    rng = random.Random(seed)
    for i, out in enumerate(outputs):
        words = [[rng.randrange(40)], out[-2:] + [rng.randrange(40)],
                 [(out[-1] + 1) % 40 if out else 0, rng.randrange(40)], [5] * 12]
        params[i] = dataclasses.replace(
            params[i], bad_words_token_ids=words if i % 3 else None,
            allowed_token_ids=None if i % 3 == 1 else rng.sample(range(40), 10))
    eos = [1, 3]
    meta = build(params, prompts=prompts, outputs=outputs, vocab_size=40, eos=eos)
    assert meta.bad_words is not None and meta.allowed_mask is not None
    want = ref_process(logits, params, prompts, outputs, eos)
    assert want.isinf().any(dim=1).all()  # every row has something banned
    torch.testing.assert_close(process_logits(logits, meta).double(), want, atol=1e-5, rtol=0)


def test_allowed_ids_and_bad_words_steer_greedy():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 4)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[3, 2]),
              # [0, 1]: the output ends with 0, so 1 is banned too.
              SamplingParams(temperature=0.0, bad_words_token_ids=[[0], [0, 1]]),
              SamplingParams(temperature=0.0, bad_words_token_ids=[[0], [4, 1]]),
              SamplingParams(temperature=0.0, logprobs=1)]
    out = sampler(logits, build(params, outputs=[[0]] * 4, vocab_size=5))
    assert out.token_ids.tolist() == [2, 2, 1, 0]


@pytest.mark.parametrize("kw,param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=["ok", 3]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=["x" * 201]), "bad_words"),
    (dict(bad_words=["w"] * 65), "bad_words"),
])
def test_bad_allowed_ids_and_bad_words_are_rejected(kw, param):
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(**kw)
    assert err.value.param == param


def test_penalty_values_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                             frequency_penalty=0.25)]
    got = process_logits(logits, build(params, prompts=[[0]], outputs=[[1, 1, 2]], vocab_size=4))
    # token 0: prompt only -> 2/2; token 1: -2*2 - (2*0.25 + 0.5); token 2: 1/2 - (0.25 + 0.5)
    torch.testing.assert_close(got, torch.tensor([[1.0, -5.0, -0.25, 0.5]]))


@pytest.mark.parametrize("value", [0.0, -1.0, 1e-38, 1e-3, 101.0, 1e38, math.inf, math.nan])
def test_repetition_penalty_out_of_range_is_rejected(value):
    """1e-38 divided positive logits into +inf, and inf - inf made NaN logprobs."""
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(repetition_penalty=value)
    assert err.value.param == "repetition_penalty"


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_extreme_repetition_penalties_keep_logprobs_finite(penalty):
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 1e4
    params = [SamplingParams(repetition_penalty=penalty, logprobs=5, temperature=t)
              for t in (0.0, 1.0)]
    every_token = [list(range(vocab))] * 2
    out = sampler(logits, build(params, prompts=every_token, outputs=every_token,
                                vocab_size=vocab))
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()


def test_logit_bias_steers_greedy():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={"3": 10.0}),  # JSON-style key
              SamplingParams(temperature=0.0, logit_bias={0: -100.0, 2: 3.0})]
    out = sampler(logits, build(params, vocab_size=4))
    assert out.token_ids.tolist() == [3, 2]


def test_min_tokens_blocks_eos_and_stop_tokens():
    eos, stop = 3, 5
    logits = torch.tensor([[7.0, 6.0, 0.0, 9.0, 0.0, 8.0, 0.0, 0.0]] * 4)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], logprobs=2)] * 3
    params.append(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop],
                                 ignore_eos=True))
    outputs = [[4], [4, 4], [4, 4, 4], [4]]
    out = sampler(logits, build(params, outputs=outputs, vocab_size=8, eos=[eos]))
    assert out.token_ids.tolist() == [0, 0, eos, eos]
    assert out.top_ids[0].tolist() == [0, 1]  # eos and the stop token are gone from the dist
    assert out.top_ids[2].tolist() == [eos, stop]


def test_out_of_vocab_token_ids_are_rejected():
    # The engine runs this check at admission; build() trusts checked params.
    with pytest.raises(InvalidSamplingParam) as err:
        check_token_ids(SamplingParams(logit_bias={40: 1.0}), vocab_size=40)
    assert err.value.param == "logit_bias"
    check_token_ids(SamplingParams(logit_bias={39: 1.0}), vocab_size=40)
    for params, param in ((SamplingParams(allowed_token_ids=[3, 40]), "allowed_token_ids"),
                          (SamplingParams(allowed_token_ids=[3] * 41), "allowed_token_ids"),
                          (SamplingParams(bad_words_token_ids=[[2, 40]]), "bad_words")):
        with pytest.raises(InvalidSamplingParam) as err:
            check_token_ids(params, vocab_size=40)
        assert err.value.param == param
    check_token_ids(SamplingParams(allowed_token_ids=[39] * 40, bad_words_token_ids=[[39]]),
                    vocab_size=40)


# ---- truncation ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k_only", [False, True])  # True takes the topk path, not the sort
def test_truncation_mask_matches_reference(seed, top_k_only):
    overrides = {"top_p": 1.0, "min_p": 0.0} if top_k_only else {}
    params, _, _, logits = random_batch(seed, 40, 50, temperature=1.3, **overrides)
    meta = build(params, vocab_size=50)
    kept = torch.isfinite(truncate(logits / 1.3, meta))
    for i, p in enumerate(params):
        assert set(kept[i].nonzero().flatten().tolist()) == ref_allowed(logits[i] / 1.3, p), i


def test_top_p_boundary_and_tiny_top_p():
    # Uniform over 4 tokens: probabilities are exactly 0.25, so a nucleus of mass exactly
    # p = 0.5 holds exactly two tokens. A tiny p still keeps the most likely token.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=1e-9)]
    kept = torch.isfinite(truncate(logits.clone(), build(params, vocab_size=4)))
    assert kept.sum(dim=-1).tolist() == [2, 1] and bool(kept[1, 1])


def _chi_square(tokens, expected_probs):
    counts = torch.bincount(tokens, minlength=len(expected_probs)).double()
    expected = expected_probs * len(tokens)
    nz = expected > 0
    assert counts[~nz].sum() == 0  # nothing sampled outside the allowed set
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum()), int(nz.sum()) - 1


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0}, {"temperature": 0.6}, {"temperature": 1.5, "top_k": 6},
    {"temperature": 0.8, "top_p": 0.8}, {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.2, "top_k": 9, "top_p": 0.9, "min_p": 0.02},
])
@pytest.mark.parametrize("seeded", [False, True])
def test_sample_frequencies_follow_the_distribution(kw, seeded):
    n, vocab_size = 20000, 12
    row = torch.randn(vocab_size, generator=torch.Generator().manual_seed(5)) * 1.5
    p = SamplingParams(**kw)
    allowed = ref_allowed(row / p.temperature, p)
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[list(allowed)] = True
    expected = torch.where(mask, probs, 0.0)
    expected /= expected.sum()
    gens = [torch.Generator().manual_seed(i) for i in range(n)] if seeded else None
    torch.manual_seed(0)
    out = sampler(row.expand(n, -1), build([p] * n, generators=gens, vocab_size=vocab_size))
    stat, dof = _chi_square(out.token_ids, expected)
    # Critical value at p ~ 1e-6 is about 5 * dof + 25; a wrong temperature or a missing
    # renormalisation gives statistics in the hundreds or thousands.
    assert stat < 5 * dof + 25, (stat, dof)
    untempered = torch.softmax(row.double(), dim=-1)
    if p.temperature != 1.0 and len(allowed) == vocab_size:
        assert _chi_square(out.token_ids, untempered)[0] > 200  # the test can tell them apart
