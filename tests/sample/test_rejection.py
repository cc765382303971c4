"""The rejection sampler against a float64 loop over sequences and positions with the same
draws, against plain decoding (penalties with drafts, seeds, no drafts at all), and by a
chi-square test of losslessness over many trials of a toy target and draft."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedserve.sample.rejection import (
    Draws,
    count_preceding_drafts,
    rejection_sample,
    target_distribution,
)
from pagedserve.sample.sampler import Sampler
from pagedserve.sampling_params import SamplingParams
from tests.sample.reference_metadata import build_metadata
from tests.sample.test_sampler import random_batch

CPU = torch.device("cpu")
EOS = [2]


def _meta(params, counts, *, prompts=None, outputs=None, gens=None, vocab):
    n = len(params)
    return build_metadata(params, prompts or [[]] * n, outputs or [[]] * n, gens or [None] * n,
                          vocab, CPU, EOS, num_positions=counts)


def _starts(counts):
    return np.cumsum([0, *counts])[:-1]


# ---- float64 reference with fixed draws ----------------------------------------------------

def reference(p, q, drafts, counts, greedy, uniform, noise):
    """Emitted tokens per sequence: ``p`` float64 [P, V] target rows, ``q`` [D, V] or None
    (point masses), one sequence and one position at a time."""
    emitted, row, q_row = [], 0, 0
    for i, count in enumerate(counts):
        num_draft, out = count - 1, []
        for j in range(num_draft):
            d, p_j = drafts[i][j], p[row + j]
            if greedy[i]:
                ok = d == int(np.argmax(p_j))
            else:
                q_d = 1.0 if q is None else q[q_row + j][d]
                ok = uniform[i][j] < min(1.0, p_j[d] / q_d)
            if not ok:
                break
            out.append(d)
        a = len(out)
        p_a = p[row + a]
        if greedy[i]:
            out.append(int(np.argmax(p_a)))
        else:
            weights = p_a
            if a < num_draft:
                q_a = np.eye(len(p_a))[drafts[i][a]] if q is None else q[q_row + a]
                residual = np.maximum(p_a - q_a, 0.0)
                weights = residual if residual.sum() > 0 else p_a
            out.append(int(np.argmax(weights / noise[i])))
        emitted.append(out)
        row, q_row = row + count, q_row + num_draft
    return emitted


def _distribution(rng, n, vocab):
    """Random rows with some exact zeros."""
    p = rng.dirichlet(np.full(vocab, 0.4), size=n)
    p[rng.random((n, vocab)) < 0.2] = 0.0
    p[np.arange(n), rng.integers(0, vocab, n)] += 0.05  # never an all-zero row
    return p / p.sum(axis=1, keepdims=True)


def _fixed_case(seed, with_q, n=300, vocab=12, k=5):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, k + 2, n).tolist()
    greedy = rng.random(n) < 0.25
    p = _distribution(rng, sum(counts), vocab)
    q = _distribution(rng, sum(counts) - n, vocab) if with_q else None
    drafts = np.full((n, k), -1)
    for i, (start, count) in enumerate(zip(_starts(counts), counts)):
        for j in range(count - 1):
            if greedy[i] and rng.random() < 0.7:
                drafts[i, j] = np.argmax(p[start + j])  # greedy rows accept now and then
            elif with_q:
                q_row = start - i + j  # q rows skip each sequence's bonus position
                drafts[i, j] = rng.choice(vocab, p=q[q_row])
            else:
                drafts[i, j] = rng.integers(vocab)
    draws = Draws(torch.from_numpy(rng.random((n, k))).float(),
                  torch.from_numpy(rng.exponential(size=(n, vocab))).float())
    return counts, greedy, p, q, drafts, draws


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_accepted_and_emitted_tokens_equal_a_float64_reference(seed, with_q):
    counts, greedy, p, q, drafts, draws = _fixed_case(seed, with_q)
    params = [SamplingParams(temperature=0.0 if g else 1.0) for g in greedy]
    meta = _meta(params, counts, vocab=p.shape[1])
    with np.errstate(divide="ignore"):
        logits = torch.from_numpy(np.log(p)).float()  # softmax gives p back
    width = max(counts)
    draws = Draws(draws.uniform[:, :width - 1], draws.exponential)
    wider = np.pad(drafts, ((0, 0), (0, 2)), constant_values=-1)  # K may exceed M - 1
    out = rejection_sample(logits, meta, torch.from_numpy(wider),
                           None if q is None else torch.from_numpy(q).float(), draws)
    want = reference(p, q, drafts, counts, greedy, draws.uniform.double().numpy(),
                     draws.exponential.double().numpy())
    assert out.num_emitted.tolist() == [len(w) for w in want]
    assert out.sampled.token_ids.tolist() == [w + [-1] * (width - len(w)) for w in want]
    accepted = [len(w) - 1 for w in want]
    assert 0 in accepted and any(a == c - 1 > 0 for a, c in zip(accepted, counts))  # both ends


def test_rows_after_the_first_rejection_never_matter():
    counts, greedy, p, q, drafts, draws = _fixed_case(11, True)
    params = [SamplingParams(temperature=0.0 if g else 1.0) for g in greedy]
    meta = _meta(params, counts, vocab=p.shape[1])
    logits, q = torch.from_numpy(np.log(p + 1e-9)).float(), torch.from_numpy(q).float()
    first = rejection_sample(logits, meta, torch.from_numpy(drafts), q, draws)
    # Scramble every row after each sequence's emitting row, logits and q alike.
    noise = torch.randn_like(logits) * 5
    for i, (start, emitted) in enumerate(zip(_starts(counts), first.num_emitted.tolist())):
        logits[start + emitted:start + counts[i]] = noise[start + emitted:start + counts[i]]
        later = slice(start - i + emitted, start - i + counts[i] - 1)  # q skips bonus rows
        q[later] = torch.rand_like(q[later]).softmax(dim=-1)
    again = rejection_sample(logits, meta, torch.from_numpy(drafts), q, draws)
    assert torch.equal(first.num_emitted, again.num_emitted)
    assert torch.equal(first.sampled.token_ids, again.sampled.token_ids)


# ---- greedy --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_emit_the_argmax_chain_up_to_the_first_mismatch(dtype):
    counts = [5, 1, 3, 5, 2]
    logits = (torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(3)) * 3)
    logits = logits.to(dtype)
    argmax = logits.float().argmax(dim=-1)
    mismatch = [1, 0, 5, 4, 0]  # the draft index that differs (past the end: none does)
    drafts = torch.full((len(counts), 4), -1)
    for i, (start, count) in enumerate(zip(_starts(counts), counts)):
        drafts[i, :count - 1] = argmax[start:start + count - 1]
        if mismatch[i] < count - 1:
            drafts[i, mismatch[i]] = (argmax[start + mismatch[i]] + 1) % 40
    meta = _meta([SamplingParams(temperature=0.0)] * len(counts), counts, vocab=40)
    out = rejection_sample(logits, meta, drafts)
    for i, (start, count) in enumerate(zip(_starts(counts), counts)):
        emitted = min(mismatch[i], count - 1) + 1
        assert out.num_emitted[i] == emitted
        assert out.sampled.token_ids[i, :emitted].tolist() == argmax[start:start + emitted].tolist()
        assert (out.sampled.token_ids[i, emitted:] == -1).all()


# ---- plain decoding's distribution at every position ---------------------------------------

def _penalised_batch(seed, counts, vocab):
    params, prompts, outputs, _ = random_batch(
        seed, len(counts), vocab, repetition_penalty=1.4, presence_penalty=0.7,
        frequency_penalty=0.5, min_tokens=6, temperature=0.9, top_p=0.95, logprobs=vocab)
    outputs = [out[:4] for out in outputs]  # short of min_tokens for a position or two
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(counts), vocab, generator=gen) * 2
    # Drafts repeat the prompt and the output, so the penalties bite.
    pool = [prompt + out + [EOS[0]] for prompt, out in zip(prompts, outputs)]
    drafts = torch.tensor([[row[j] for j in torch.randint(len(row), (4,), generator=gen)]
                           for row in pool])
    return params, prompts, outputs, logits, drafts


@pytest.mark.parametrize("seed", range(3))
def test_each_position_sees_plain_decodings_distribution_after_its_drafts(seed):
    """Position j of a sequence is the plain sampler's row for the sequence with its first j
    drafts appended: penalties count them, min_tokens counts them, as plain decoding would."""
    counts, vocab = [5, 1, 3, 4], 20  # logprobs=20: all of them
    params, prompts, outputs, logits, drafts = _penalised_batch(seed, counts, vocab)
    meta = _meta(params, counts, prompts=prompts, outputs=outputs, vocab=vocab)
    verified = _verified_equals_plain_after_drafts(params, prompts, outputs, logits, drafts,
                                                   counts, vocab, meta)
    # Without the drafts counted, later positions differ: the check above can fail.
    stale = target_distribution(logits, meta)
    assert not torch.equal(stale.logits, verified.logits)


def _verified_equals_plain_after_drafts(params, prompts, outputs, logits, drafts, counts,
                                        vocab, meta):
    """The verified distribution, each position checked against the plain sampler's row for
    its sequence with the drafts before it appended."""
    verified = target_distribution(logits, count_preceding_drafts(meta, drafts))
    for i, (start, count) in enumerate(zip(_starts(counts), counts)):
        for j in range(count):
            plain = build_metadata([params[i]], [prompts[i]], [outputs[i] + drafts[i, :j].tolist()],
                                   [None], vocab, CPU, EOS)
            want = target_distribution(logits[start + j:start + j + 1], plain)
            torch.testing.assert_close(verified.logits[start + j], want.logits[0], rtol=0, atol=0)
            torch.testing.assert_close(verified.probs[start + j], want.probs[0], rtol=0, atol=0)
    return verified


def _bad_words_after_drafts(seed, counts, vocab, **overrides):
    """Rows whose bad words continue their drafts (and their output's last token), so that a
    later position bans a token only where the drafts before it are matched."""
    params, prompts, outputs, _ = random_batch(seed, len(counts), vocab, allowed_token_ids=None,
                                               **overrides)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(counts), vocab, generator=gen) * 2
    drafts = torch.randint(vocab, (len(counts), max(counts) - 1), generator=gen)
    banned = torch.randint(vocab, (len(counts), 4), generator=gen).tolist()
    for i, (d, b) in enumerate(zip(drafts.tolist(), banned)):
        words = [[d[0], b[0]], [d[0], d[1], b[1]], outputs[i][-1:] + [d[0], b[2]], [d[1], b[3]]]
        params[i] = dataclasses.replace(params[i], bad_words_token_ids=words)
    return params, prompts, outputs, logits, drafts


@pytest.mark.parametrize("seed", range(3))
def test_bad_words_at_each_position_match_its_preceding_drafts(seed):
    counts, vocab = [5, 1, 3, 4], 20
    params, prompts, outputs, logits, drafts = _bad_words_after_drafts(
        seed, counts, vocab, temperature=0.9, top_p=0.95, logprobs=vocab)
    meta = _meta(params, counts, prompts=prompts, outputs=outputs, vocab=vocab)
    verified = _verified_equals_plain_after_drafts(params, prompts, outputs, logits, drafts,
                                                   counts, vocab, meta)
    stale = target_distribution(logits, meta)
    assert not torch.equal(stale.logits.isinf(), verified.logits.isinf())


def test_greedy_with_drafts_and_bad_words_emits_plain_decodings_tokens():
    """Drafts that are plain greedy decoding's own tokens, under bad words that ban the raw
    argmax after a draft: every draft is accepted, and the tokens are plain decoding's."""
    counts, vocab = [5, 3, 4], 20
    params, prompts, outputs, logits, _ = _bad_words_after_drafts(
        1, counts, vocab, temperature=0.0, logit_bias=None, min_tokens=0,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)

    def plain_chain(i, start, count):
        chain = []
        for j in range(count):
            meta = build_metadata([params[i]], [prompts[i]], [outputs[i] + chain], [None],
                                  vocab, CPU, EOS)
            chain.append(int(Sampler()(logits[start + j:start + j + 1], meta).token_ids[0, 0]))
        return chain

    for i, (start, count) in enumerate(zip(_starts(counts), counts)):
        # Ban, after each token of the chain, the raw argmax of the position that follows it.
        words = [[tok, int(logits[start + j + 1].argmax())]
                 for j, tok in enumerate(plain_chain(i, start, count)[:-1])]
        params[i] = dataclasses.replace(params[i], bad_words_token_ids=words)
    chains = [plain_chain(i, start, count) for i, (start, count)
              in enumerate(zip(_starts(counts), counts))]
    raw = logits.argmax(dim=-1).tolist()
    assert any(tok != raw[start + j] for chain, start in zip(chains, _starts(counts))
               for j, tok in enumerate(chain) if j > 0)  # the bans change the chain
    drafts = torch.tensor([chain[:-1] + [-1] * (max(counts) - len(chain)) for chain in chains])
    out = rejection_sample(logits, _meta(params, counts, prompts=prompts, outputs=outputs,
                                         vocab=vocab), drafts)
    assert out.num_emitted.tolist() == counts
    for i, chain in enumerate(chains):
        assert out.sampled.token_ids[i, :len(chain)].tolist() == chain


def test_logprobs_are_plain_decodings_for_every_emitted_token():
    counts, vocab = [5, 1, 3, 4], 20  # logprobs=20: all of them
    params, prompts, outputs, logits, drafts = _penalised_batch(5, counts, vocab)
    meta = _meta(params, counts, prompts=prompts, outputs=outputs, vocab=vocab)
    accept_all = Draws(torch.zeros(len(counts), max(counts) - 1),
                       torch.ones(len(counts), vocab))
    out = rejection_sample(logits, meta, drafts, draws=accept_all)
    assert out.num_emitted.sum() > len(counts)  # some drafts accepted
    for i, (start, emitted) in enumerate(zip(_starts(counts), out.num_emitted.tolist())):
        for j in range(emitted):
            plain = build_metadata([params[i]], [prompts[i]], [outputs[i] + drafts[i, :j].tolist()],
                                   [None], vocab, CPU, EOS)
            row = Sampler()(logits[start + j:start + j + 1], plain)
            token = out.sampled.token_ids[i, j]
            log_softmax = row.top_logprobs[0, 0][row.top_ids[0, 0].argsort()]  # all V of them
            assert out.sampled.logprobs[i, j] == log_softmax[token]
            assert out.sampled.ranks[i, j] == (log_softmax > log_softmax[token]).sum() + 1
            assert torch.equal(out.sampled.top_logprobs[i, j], row.top_logprobs[0, 0])


# ---- seeds ---------------------------------------------------------------------------------

def _seeded_batch(seed, counts, vocab=48):
    params, prompts, outputs, _ = random_batch(seed, len(counts), vocab, temperature=0.8)
    params = [dataclasses.replace(p, seed=1000 * seed + i) if i % 3 else p
              for i, p in enumerate(params)]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(counts), vocab, generator=gen) * 1.5
    drafts = torch.randint(vocab, (len(counts), max(counts) - 1), generator=gen)
    q = torch.randn(sum(counts) - len(counts), vocab, generator=gen).softmax(dim=-1)
    return params, prompts, outputs, logits, drafts, q


def _generators(params):
    return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_a_seeded_sequence_emits_the_same_alone_as_in_a_batch(seed, with_q):
    counts, vocab = [4, 2, 1, 5, 3, 4], 48
    params, prompts, outputs, logits, drafts, q = _seeded_batch(seed, counts, vocab)
    torch.manual_seed(seed)
    meta = _meta(params, counts, prompts=prompts, outputs=outputs, gens=_generators(params),
                 vocab=vocab)
    batch = rejection_sample(logits, meta, drafts, q if with_q else None)
    starts, q_starts = _starts(counts), _starts([c - 1 for c in counts])
    for i, count in enumerate(counts):
        if params[i].seed is None:
            continue
        torch.manual_seed(seed + 1)  # another default stream: seeded rows never read it
        alone_meta = _meta([params[i]], [count], prompts=[prompts[i]], outputs=[outputs[i]],
                           gens=_generators([params[i]]), vocab=vocab)
        alone = rejection_sample(logits[starts[i]:starts[i] + count], alone_meta,
                                 drafts[i:i + 1],
                                 q[q_starts[i]:q_starts[i] + count - 1] if with_q else None)
        assert alone.num_emitted[0] == batch.num_emitted[i]
        assert torch.equal(alone.sampled.token_ids[0, :count], batch.sampled.token_ids[i, :count])


@pytest.mark.parametrize("seed", range(3))
def test_without_drafts_it_samples_as_the_plain_sampler_bit_for_bit(seed):
    n, vocab = 7, 48
    params, prompts, outputs, logits, _, _ = _seeded_batch(seed, [1] * n, vocab)
    params = [dataclasses.replace(p, logprobs=3) for p in params]

    def run(sample):
        torch.manual_seed(seed)
        meta = _meta(params, [1] * n, prompts=prompts, outputs=outputs,
                     gens=_generators(params), vocab=vocab)
        return sample(logits, meta)

    plain = run(Sampler())
    no_drafts = torch.empty(n, 0, dtype=torch.int64)
    verified = run(lambda logits, meta: rejection_sample(logits, meta, no_drafts))
    assert verified.num_emitted.tolist() == [1] * n
    for got, want in zip(verified.sampled, plain, strict=True):
        assert torch.equal(got, want)


# ---- losslessness --------------------------------------------------------------------------

VOCAB, K, TOKENS, START = 5, 3, 3, 5


def _nucleus(logits, top_p):
    """float64 softmax restricted to the smallest most-likely set whose mass reaches top_p."""
    p = torch.softmax(logits.double(), dim=-1).numpy()
    kept, mass = np.zeros_like(p), 0.0
    for t in np.argsort(-p):
        if mass >= top_p:
            break
        kept[t], mass = p[t], mass + p[t]
    return kept / kept.sum()


def _generate(target, draft, trials, top_p, with_q):
    """The first TOKENS tokens of ``trials`` sequences through verify steps of K drafts, each
    drafted from the draft model; ``target``/``draft``: logits [length, last token, V].
    Also the mean number of tokens the first step emitted."""
    gen = torch.Generator().manual_seed(1)  # the drafter's
    torch.manual_seed(2)  # the sampler's
    params = SamplingParams(temperature=1.0, top_p=top_p)
    history = torch.full((trials, TOKENS + K + 1), -1)
    lengths = torch.zeros(trials, dtype=torch.int64)
    first_step = None
    while (lengths < TOKENS).any():
        rows = torch.nonzero(lengths < TOKENS).squeeze(1)
        length = lengths[rows]
        last = torch.where(length > 0, history[rows, (length - 1).clamp_min(0)], START)
        drafts, qs, logits = [], [], [target[length, last]]
        for j in range(K):
            q = draft[length + j, last].softmax(dim=-1)
            last = torch.multinomial(q, 1, generator=gen).squeeze(1)
            drafts.append(last)
            qs.append(q)
            logits.append(target[length + j + 1, last])
        n = len(rows)
        meta = build_metadata([params] * n, [[]] * n, [[]] * n, [None] * n, VOCAB, CPU, [],
                              num_positions=[K + 1] * n)
        out = rejection_sample(torch.stack(logits, 1).flatten(0, 1), meta,
                               torch.stack(drafts, 1),
                               torch.stack(qs, 1).flatten(0, 1) if with_q else None)
        j = torch.arange(K + 1)
        keep = j < out.num_emitted.unsqueeze(1)
        cols = length.unsqueeze(1) + j
        history[rows.unsqueeze(1).expand(-1, K + 1)[keep], cols[keep]] = out.sampled.token_ids[keep]
        lengths[rows] += out.num_emitted
        first_step = first_step or out.num_emitted.double().mean().item()
    return history[:, :TOKENS], first_step


def _chi_square(samples, expected):
    """Pearson's statistic over the joint cells, those expected below 5 pooled."""
    cells = (samples * torch.tensor([VOCAB ** 2, VOCAB, 1])).sum(dim=1)
    counts = torch.bincount(cells, minlength=VOCAB ** TOKENS).double().numpy()
    expected = expected.ravel() * len(samples)
    assert counts[expected == 0].sum() == 0  # nothing outside the target's nuclei
    small = (expected > 0) & (expected < 5)
    obs, exp = counts[expected >= 5], expected[expected >= 5]
    if small.any():
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


@pytest.mark.parametrize("with_q", [True, False])
def test_the_first_tokens_follow_the_target_whatever_the_draft(with_q):
    """The joint distribution of the first three tokens, over 20,000 trials of verify steps
    whose drafts come from a clearly different model, is the target's own (temperature 1,
    top-p 0.9), by a chi-square test against the exact probabilities. Accepting whenever the
    draft is the target's argmax (a lossy rule) gives statistics in the thousands here."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(TOKENS + K + 1, VOCAB + 1, VOCAB, generator=gen)
    draft = torch.randn(TOKENS + K + 1, VOCAB + 1, VOCAB, generator=gen)
    top_p = 0.9
    p1 = _nucleus(target[0, START], top_p)
    expected = np.zeros((VOCAB,) * TOKENS)
    for a in range(VOCAB):
        p2 = _nucleus(target[1, a], top_p)
        for b in range(VOCAB):
            expected[a, b] = p1[a] * p2[b] * _nucleus(target[2, b], top_p)
    samples, emitted = _generate(target, draft, 20000, top_p, with_q)
    stat, dof = _chi_square(samples, expected)
    # The critical value at p ~ 1e-6 is about 5 * dof + 25.
    assert stat < 5 * dof + 25, (stat, dof)
    assert 1.3 < emitted < 3  # drafts were often accepted, and often not
