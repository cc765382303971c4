"""EAGLE-3 on the GPU: the head's draft logits, drawn eagerly, equal EAGLE-3's definition in
float64 (``tests/eagle3_heads.py``) while drafts are accepted; the chained passes replayed as
one CUDA graph per batch size draw the same drafts as eager drafting, step by step; and the
output equals the plain engine's."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.worker.eagle_drafter import EagleDrafter
from tests.devices import HAS_NVIDIA, NVIDIA_REASON
from tests.eagle3_heads import write_eagle3_head
from tests.tiny_models import VOCAB, write_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON),
]

NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")
    head = write_eagle3_head(tmp_path_factory.mktemp("eagle3"), target, seed=3,
                             draft_vocab_size=VOCAB)
    return target, head


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 33, 70, 17)]


def _llm(target, head=None, eager=True):
    spec = None if head is None else {"method": "eagle3", "model": str(head),
                                      "num_speculative_tokens": 4}
    llm = LLM(model=str(target), device="cuda", dtype="float32", enforce_eager=eager,
              gpu_memory_utilization=0.3, speculative_config=spec)
    if head is not None:
        from tests.engine.test_speculative_lossless import FreeDrafts

        llm.engine.speculation.step_times = FreeDrafts()
    return llm


def _outputs(llm, prompts):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                               use_tqdm=False)]


def test_draft_logits_on_gpu_equal_eagle3_s_definition(models, monkeypatch):
    from tests.engine.test_speculative_eagle3 import (
        DraftRecorder,
        _assert_logits_match_the_reference,
    )

    target, head = models
    prompts = _prompts()
    plain = _outputs(_llm(target), prompts)
    recorder = DraftRecorder(monkeypatch, {tuple(p): p + o for p, o in zip(prompts, plain)})
    llm = _llm(target, head)
    assert _outputs(llm, prompts) == plain
    assert llm.engine.speculation.counters.accepted_per_position[2] > 0
    _assert_logits_match_the_reference(recorder, head, target)


def test_chain_graphs_draw_the_eager_drafts(models, monkeypatch):
    target, head = models
    prompts = _prompts()
    plain = _outputs(_llm(target), prompts)
    recorded: list[list] = []
    original = EagleDrafter.propose

    def propose(drafter, scheduled, sampling):
        out = original(drafter, scheduled, sampling)
        recorded[-1].append(out.token_ids.tolist())
        return out

    monkeypatch.setattr(EagleDrafter, "propose", propose)
    runs = {}
    for eager in (True, False):
        llm = _llm(target, head, eager)
        drafter = llm.engine.executor.runner.drafter
        assert (drafter.graphs is None) == eager
        recorded.append([])
        assert _outputs(llm, prompts) == plain
        runs[eager] = recorded[-1]
    assert len(runs[True]) > 10 and runs[False] == runs[True]
