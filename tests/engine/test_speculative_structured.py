"""Structured output with speculation, on the default model: a constrained sequence gets
n-gram drafts, cut at the first its grammar refuses, each verified position masked as after
the drafts before it, and no draft ever advances the matcher.

The drafts come from an oracle: the engine's own greedy continuation without speculation,
corrupted by turns with a token the grammar refuses (the engine must cut the drafts there)
or a token it allows but the model would not choose (the target must reject it). Every
output validates and equals the one without speculation; after every step each matcher is
in the state of a fresh matcher fed exactly the sequence's output tokens; and every draft a
step verified was valid for the grammar after the tokens before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.engine.speculation import Speculation
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.proposer import DRAFTED_ON_DEVICE, ProposalBatch
from pagedserve.structured.spec import grammar_spec
from tests.engine.test_speculative_lossless import FreeDrafts
from tests.engine.test_structured_output import DATE, PERSON, _valid_date, _valid_person
from tests.kv_checks import assert_pools_full
from tests.tiny_models import make_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# The free request comes first: its drafts' rows come before the constrained rows' masks.
PROMPTS = ["Write a poem about the sea.", "Describe a person as JSON:", "Today's date is"]
STRUCTURED = [None, StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=DATE)]
CHECKS = [None, _valid_person, _valid_date]
NEW_TOKENS = 48


def _params() -> list[SamplingParams]:
    """Greedy; the free request ignores EOS (the model would end it at once)."""
    return [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, structured_outputs=s,
                           ignore_eos=s is None) for s in STRUCTURED]


class _Matcher:
    """A fresh xgrammar matcher (the test's own, independent of the engine's)."""

    def __init__(self, compiled, tokens: list[int]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        assert all(self.matcher.accept_token(t) for t in tokens)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next."""
        return _allowed(self.matcher.fill_next_token_bitmask, self.vocab_size)

    def num_valid(self, drafts: list[int]) -> int:
        """Leading drafts the grammar allows, none of them ending it (this mutates)."""
        for j, token in enumerate(drafts):
            if not self.matcher.accept_token(token) or self.matcher.is_terminated():
                return j
        return len(drafts)


class GrammarOracle:
    """Drafts from known continuations. By turns (the row's length mod 3), the draft in the
    middle is replaced by a token the grammar refuses there, by one it allows but the
    continuation does not take, or kept; free rows get a wrong token for the first two.
    ``pause_every``: so many calls with drafts, then so many without any (the engine pauses
    speculation for 1, 2, 4 ... steps and runs ahead meanwhile), and so on."""

    def __init__(self, continuations: dict[tuple[int, ...], tuple[list[int], object]],
                 vocab_size: int, pause_every: int = 0) -> None:
        self.continuations = continuations
        self.vocab_size = vocab_size
        self.pause_every = pause_every
        self.calls = 0
        self.refused = 0  # constrained drafts made a token the grammar refuses
        self.allowed_wrong = 0  # ... a token it allows that the continuation does not take

    def propose(self, batch: ProposalBatch) -> list[np.ndarray]:
        self.calls += 1
        pause = self.pause_every and (self.calls // self.pause_every) % 2 == 1
        return [np.asarray([] if pause else self._draft(list(tokens), k), dtype=np.int64)
                for tokens, k in zip(batch.token_ids, batch.num_tokens, strict=True)]

    def _draft(self, tokens: list[int], k: int) -> list[int]:
        for prompt, (ref, compiled) in self.continuations.items():
            done = len(tokens) - len(prompt)
            if done > 0 and tuple(tokens[:len(prompt)]) == prompt:
                assert tokens[len(prompt):] == ref[:done], "the output left the reference"
                draft = list(ref[done:done + k])
                if draft and len(tokens) % 3 < 2:
                    mid = len(draft) // 2
                    draft[mid] = self._corrupt(ref[:done + mid], draft[mid], compiled,
                                               refuse=len(tokens) % 3 == 0)
                return draft
        return []

    def _corrupt(self, before: list[int], token: int, compiled, refuse: bool) -> int:
        if compiled is None:
            return (token + 1) % self.vocab_size
        allowed = _Matcher(compiled, before).allowed()
        allowed[token] = not refuse  # never the continuation's own token
        candidates = torch.nonzero(allowed != refuse).flatten()
        if not len(candidates):
            return token
        self.refused += refuse
        self.allowed_wrong += not refuse
        return int(candidates[0])


@pytest.fixture(scope="module")
def reference(default_llm):
    """The greedy outputs without speculation, and each request's compiled grammar."""
    outputs = default_llm.generate(PROMPTS, _params(), use_tqdm=False)
    compiled = [None if s is None else
                default_llm.engine.grammars.get(grammar_spec(s)).result() for s in STRUCTURED]
    prompt_ids = [o.prompt_token_ids for o in outputs]
    return outputs, {tuple(p): (o.outputs[0].token_ids, c)
                     for p, o, c in zip(prompt_ids, outputs, compiled, strict=True)}


def _spec_llm(folder, reference, **options):
    # float32 activations: the reference engine is dense float32, which int8 activations
    # would move greedy tokens away from (docs/platforms.md)
    llm = make_llm(folder, speculative_config=NGRAM, kv_cache_memory_bytes=64 << 20,
                   int8_activations=False, **options)
    # Compiled beforehand, so the constrained requests run alongside the free one from the
    # start, however long the compile worker takes to start.
    for s in STRUCTURED:
        if s is not None:
            llm.engine.grammars.get(grammar_spec(s)).result()
    oracle = GrammarOracle(reference[1], llm.engine.arch.vocab_size)
    llm.engine.speculation.proposer = oracle
    llm.engine.speculation.step_times = FreeDrafts()  # what is drafted depends on no timing
    return llm, oracle


class StepChecks:
    """Around every engine step: each draft a constrained sequence is scheduled to verify
    is valid for a fresh matcher fed its output so far; after the step, each live matcher
    allows exactly what a fresh matcher fed exactly the output tokens allows."""

    def __init__(self, llm, compiled: dict[tuple[int, ...], object]) -> None:
        self.engine, self.compiled = llm.engine, compiled
        self.constrained_drafts = 0  # drafts of constrained sequences scheduled
        self.schedules: list[tuple[bool, bool, bool]] = []  # (pending, in flight, drafts)
        schedule = self.engine.scheduler.schedule

        def checked(schedule_pending: bool = False, **kwargs):
            out = schedule(schedule_pending=schedule_pending, **kwargs)
            for item in out.scheduled:
                self._check_drafts(item.seq, list(item.draft_token_ids))
            self.schedules.append((schedule_pending, self.engine._in_flight is not None,
                                   any(s.draft_token_ids for s in out.scheduled)))
            return out

        self.engine.scheduler.schedule = checked

    def _compiled_of(self, seq):
        return self.compiled.get(tuple(seq.prompt_token_ids))

    def _check_drafts(self, seq, drafts: list[int]) -> None:
        compiled = self._compiled_of(seq)
        if compiled is None or not drafts:
            return
        matcher = _Matcher(compiled, seq.output_token_ids)
        assert matcher.num_valid(drafts) == len(drafts), "a refused draft was verified"
        self.constrained_drafts += len(drafts)

    def after_step(self) -> None:
        for request in self.engine.outputs.requests.values():
            for state in request.seqs:
                if state.grammar is None or state.finished:
                    continue
                fresh = _Matcher(self._compiled_of(state.seq), state.seq.output_token_ids)
                assert not state.grammar.terminated
                assert torch.equal(_allowed(state.grammar.fill, fresh.vocab_size),
                                   fresh.allowed())

    def run(self, prompts, params) -> list:
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finished = {}
        while self.engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in self.engine.step() if o.finished})
            self.after_step()
        return [finished[i] for i in ids]


def _allowed(fill, vocab_size: int) -> torch.Tensor:
    """bool [V] from ``fill(bitmask, row)``'s one row."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    fill(bitmask, 0)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def _assert_same_and_valid(outputs, reference_outputs) -> None:
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in reference_outputs]
    for output, check in zip(outputs, CHECKS, strict=True):
        if check is not None:
            assert output.outputs[0].finish_reason == "stop"
            check(output.outputs[0].text)


def test_constrained_drafts_are_cut_masked_and_never_advance_the_matcher(
        default_model_folder, reference):
    llm, oracle = _spec_llm(default_model_folder, reference)
    checks = StepChecks(llm, {p: c for p, (_, c) in reference[1].items() if c is not None})
    outputs = checks.run(PROMPTS, _params())
    _assert_same_and_valid(outputs, reference[0])
    c = llm.engine.speculation.counters
    # Refused drafts were proposed (and cut), allowed wrong ones verified (and rejected),
    # and constrained sequences verified drafts, some of them accepted.
    assert oracle.refused > 0 and oracle.allowed_wrong > 0 and checks.constrained_drafts > 0
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert_pools_full(llm.engine.kv)
    llm.shutdown()


def test_async_scheduling_with_grammar_and_speculation(default_model_folder, reference):
    """Proposing steps run one at a time (nothing in flight, nothing scheduled ahead); while
    speculation pauses, constrained rows run ahead with masks built between the forward pass
    and the sampling; the tokens are the same."""
    llm, _ = _spec_llm(default_model_folder, reference, async_scheduling=True)
    llm.engine.speculation.proposer.pause_every = 3
    masked_ahead = []
    run_masked_ahead = llm.engine._run_masked_ahead

    def logged(out, previous):
        masked_ahead.append(out)
        return run_masked_ahead(out, previous)

    llm.engine._run_masked_ahead = logged
    checks = StepChecks(llm, {p: c for p, (_, c) in reference[1].items() if c is not None})
    outputs = checks.run(PROMPTS, _params())
    _assert_same_and_valid(outputs, reference[0])
    drafted = [(pending, in_flight) for pending, in_flight, d in checks.schedules if d]
    assert drafted and not any(pending or in_flight for pending, in_flight in drafted)
    assert masked_ahead and checks.constrained_drafts > 0
    assert llm.engine.speculation.counters.num_accepted_tokens > 0
    assert_pools_full(llm.engine.kv)
    llm.shutdown()


class _CutAt:
    """A grammar stand-in that allows the first ``n`` drafts of any run."""

    def __init__(self, n: int) -> None:
        self.n = n

    def num_valid(self, drafts: list[int]) -> int:
        return min(self.n, len(drafts))


def _decoding(structured: bool) -> Sequence:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=DATE)
                            if structured else None)
    seq = Sequence([1, 2, 3, 1, 2, 3, 1, 2], params, max_tokens=20)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_which_rows_draft_and_how_grammars_cut_them(method):
    """n-gram drafts of a constrained row are cut where its grammar says, before the policy;
    a draft model's (drawn on the device, where no matcher is) are not given to it at all."""
    config = SpeculativeConfig(method, 4, prompt_lookup_max=2, prompt_lookup_min=2,
                               model="draft" if method == "draft_model" else None)
    speculation = Speculation(config)
    speculation.step_times = FreeDrafts()
    free, constrained = _decoding(False), _decoding(True)
    grammars = {constrained: _CutAt(1)}
    speculation.propose([SequenceGroup("a", [free]), SequenceGroup("b", [constrained])], 64,
                        grammars.get)
    if method == "ngram":  # "1 2" last came before "3 1 2"
        assert free.draft_token_ids == [3, 1, 2] and constrained.draft_token_ids == [3]
    else:
        assert free.draft_token_ids == [DRAFTED_ON_DEVICE] * 4
        assert constrained.draft_token_ids == []
