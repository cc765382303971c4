"""Speculative decoding with an EAGLE-3 head (``method: eagle3``; ``worker/eagle_drafter.py``):

- every draft logit the head computes in the engine equals EAGLE-3's definition computed in
  float64 from transformers' hidden states (``tests/eagle3_heads.py``), step after step, while
  drafts are accepted (some drafts are forced right, so a step's accepted length varies) and
  through chunked prefill, prefix-cache hits and recompute preemption;
- greedy output equals transformers' (random heads accept almost nothing on their own), also
  through swap preemption and with n = 3;
- sampling stays distributed as without speculation (a two-sample test that accepting the
  drafts unchecked fails);
- the loader reads the public layout (``pytorch_model.bin`` or safetensors, with or without
  an embedding table), infers the method from the folder, and refuses a head that does not fit
  its target with a one-line error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.worker.eagle_drafter import EagleDrafter
from tests.eagle3_heads import ReferenceEagle3, read_tensors, write_eagle3_head
from tests.engine.test_speculative import (
    assert_greedy_through_mechanism,
    assert_n_3_greedy_equals_one_and_seeded_repeats,
    mechanism_options,
    mechanism_prompts,
)
from tests.engine.test_speculative_lossless import (
    NUM_REQUESTS,
    P_MIN,
    FreeDrafts,
    _p_values,
    accept_every_draft,
)
from tests.kv_checks import assert_pools_full
from tests.tiny_models import (
    assert_greedy_matches,
    hf_greedy,
    hf_model,
    make_llm,
    random_prompts,
)


@pytest.fixture(scope="module")
def heads(tiny_model_folder, tmp_path_factory):
    """``heads(name)``: a random head for the Llama target (or ``target``'s): ``full`` has the
    whole vocabulary as its draft vocabulary (so forced drafts are always expressible),
    ``reduced`` 200 of 384 tokens."""
    made = {}

    def head(name: str, target: str = "llama3"):
        if (name, target) not in made:
            vocab = {"full": 384, "reduced": 200}[name]
            made[name, target] = write_eagle3_head(
                tmp_path_factory.mktemp(f"eagle3-{name}-{target}"), tiny_model_folder(target),
                seed=len(made) + 1, draft_vocab_size=vocab)
        return made[name, target]

    return head


def _spec(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _eagle_llm(folder, head, k: int = 3, **options):
    llm = make_llm(folder, speculative_config=_spec(head, k), **options)
    llm.engine.speculation.step_times = FreeDrafts()  # what is drafted depends on no timing
    return llm


def _counters(llm):
    return llm.engine.speculation.counters


class DraftRecorder:
    """Stands in for the drafters' ``draw``: records every pass's logits with what the pass
    was fed, and returns the head's argmax, except that in step s the first ``s % 4`` drafts
    of each row are forced to the target's greedy continuation (``full``: prompt tuple ->
    prompt plus greedy output), so verify steps accept 0 to 3 drafts."""

    def __init__(self, monkeypatch, full: dict[tuple[int, ...], list[int]]) -> None:
        self.full, self.records, self.step = full, [], 0
        original = EagleDrafter.propose

        def propose(drafter, scheduled, sampling):
            self.items = [s for s in scheduled if s.draft_token_ids]
            self.tokens = [list(s.seq.all_token_ids[:s.num_computed_tokens + 1])
                           for s in self.items]
            self.fed = [[] for _ in self.items]
            self.j, self.step = 0, self.step + 1
            ids = drafter.head.draft_to_target.tolist()
            self.to_target, self.to_draft = ids, {t: i for i, t in enumerate(ids)}
            return original(drafter, scheduled, sampling)

        monkeypatch.setattr(EagleDrafter, "propose", propose)
        monkeypatch.setattr("pagedserve.worker.eagle_drafter.draw", self.draw)

    def draw(self, logits, meta, rows, rows_t):
        assert meta.all_greedy
        j, self.j = self.j, self.j + 1
        drawn = logits.argmax(dim=-1)
        for k, i in enumerate(rows):
            item = self.items[i]
            self.records.append((self.tokens[i], list(self.fed[i]), logits[k].double().cpu()))
            full = self.full[tuple(item.seq.prompt_token_ids)]
            position = item.num_computed_tokens + 1 + j
            if j < self.step % 4 and position < len(full) and full[position] in self.to_draft:
                drawn[k] = self.to_draft[full[position]]
            self.fed[i].append(self.to_target[int(drawn[k])])
        return drawn, None


def _greedy_references(folder, prompts, new_tokens):
    hf = hf_model(folder)
    return {tuple(p): p + hf_greedy(hf, p, new_tokens) for p in prompts}


def _assert_logits_match_the_reference(recorder, head, folder, min_records: int = 30) -> None:
    reference = ReferenceEagle3(head, folder)
    assert len(recorder.records) > min_records
    worst = 0.0
    for tokens, fed, logits in recorder.records:
        expected = reference.pass_logits(tokens, fed)[-1]
        worst = max(worst, float((logits - expected).abs().max()))
    # float32 against float64 over a 3-layer computation: about 1e-6 is expected.
    assert worst < 2e-4, worst


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_every_draft_logit_equals_eagle3_s_definition_while_drafts_are_accepted(
        llama3_folder, heads, monkeypatch, vocab):
    prompts = random_prompts(f"eagle3-{vocab}", [5, 23, 12])
    full = _greedy_references(llama3_folder, prompts, 24)
    recorder = DraftRecorder(monkeypatch, full)
    llm = _eagle_llm(llama3_folder, heads(vocab))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert prompt + list(out.outputs[0].token_ids) == full[tuple(prompt)]
    c = _counters(llm)
    # Forced drafts are accepted, the head's own rarely: rows accepted 0, 1, 2 and 3 drafts.
    assert c.accepted_per_position[2] > 0 and c.num_accepted_tokens < c.num_draft_tokens
    _assert_logits_match_the_reference(recorder, heads(vocab), llama3_folder)
    assert_pools_full(llm.engine.kv)


@pytest.mark.parametrize("case", ["chunked_prefill", "prefix_hits", "recompute"])
def test_draft_logits_equal_the_definition_through_the_engine_s_mechanisms(
        llama3_folder, heads, monkeypatch, case):
    """The head's keys follow the target's through split prompts, cached prefixes (whose
    next token is shared too: 40 shared tokens cache 32) and recomputed sequences."""
    prompts = mechanism_prompts(f"eagle3-{case}")
    full = _greedy_references(llama3_folder, prompts, 20)
    llm = _eagle_llm(llama3_folder, heads("full"), **mechanism_options(case, 16))
    if case == "prefix_hits":
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    recorder = DraftRecorder(monkeypatch, full)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert prompt + list(out.outputs[0].token_ids) == full[tuple(prompt)]
    stats = llm.engine.stats()
    if case == "prefix_hits":
        assert stats.prefix_hit_tokens > 0
    if case == "recompute":
        assert stats.num_preemptions > 0
    _assert_logits_match_the_reference(recorder, heads("full"), llama3_folder)
    assert_pools_full(llm.engine.kv)


def test_a_deliberately_wrong_shift_fails_the_definition_check(llama3_folder, heads,
                                                               monkeypatch):
    """The check above can fail: a head fed each position's own token instead of the next
    one (the shift left out, but for the sampled tokens) gives other logits."""
    prompts = random_prompts("eagle3-broken", [9])
    full = _greedy_references(llama3_folder, prompts, 12)
    original = EagleDrafter.extend

    def unshifted(drafter, inputs, *rest):
        late = dataclasses.replace(inputs, input_ids=torch.roll(inputs.input_ids, 1))
        original(drafter, late, *rest)

    monkeypatch.setattr(EagleDrafter, "extend", unshifted)
    recorder = DraftRecorder(monkeypatch, full)
    llm = _eagle_llm(llama3_folder, heads("full"))
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    with pytest.raises(AssertionError):
        _assert_logits_match_the_reference(recorder, heads("full"), llama3_folder, 10)


class EveryOtherProposal:
    """A step-time model under which drafts pay at every other proposal: speculation pauses
    in between and, with async scheduling, the engine schedules ahead (steps whose inputs are
    still on the device), so the head's extend runs on both kinds of step."""

    def __init__(self) -> None:
        self.calls = 0

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        self.calls += 1
        return (1.0, 0.0, 0.0) if self.calls % 2 else (1.0, 1.0, 0.0)


def test_draft_logits_equal_the_definition_across_paused_steps_run_ahead(
        llama3_folder, heads, monkeypatch):
    prompts = random_prompts("eagle3-async", [7, 19])
    full = _greedy_references(llama3_folder, prompts, 24)
    recorder = DraftRecorder(monkeypatch, full)
    llm = _eagle_llm(llama3_folder, heads("full"), async_scheduling=True)
    llm.engine.speculation.step_times = EveryOtherProposal()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        llm.engine.add_request(prompt, params)
    ran_ahead = False
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        ran_ahead |= llm.engine._in_flight is not None
    assert ran_ahead and _counters(llm).num_accepted_tokens > 0
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert prompt + list(out.outputs[0].token_ids) == full[tuple(prompt)]
    _assert_logits_match_the_reference(recorder, heads("full"), llama3_folder, 10)


@pytest.mark.parametrize("target", ["llama3", "qwen3"])  # qwen3: a Llama head, q/k-norm target
@pytest.mark.parametrize("case", ["swap", "prefix_hits"])
def test_greedy_with_an_eagle3_head_equals_transformers(tiny_model_folder, heads, case, target):
    """The head's own drafts (random: almost all rejected); swapped-in blocks leave its keys
    stale, which costs acceptance, never the output."""
    prompts = mechanism_prompts(f"eagle3-greedy-{case}")
    folder = tiny_model_folder(target)
    llm = _eagle_llm(folder, heads("reduced", target), **mechanism_options(case, 16))
    assert_greedy_through_mechanism(llm, folder, prompts, case)
    assert _counters(llm).num_draft_tokens > 0


def test_n_3_with_an_eagle3_head(llama3_folder, heads):
    llm = _eagle_llm(llama3_folder, heads("reduced"))
    assert_n_3_greedy_equals_one_and_seeded_repeats(llm, llama3_folder,
                                                    random_prompts("eagle3-n3", [7]))
    assert _counters(llm).num_draft_tokens > 0


# Sampling: temperature 1, where a random head's q overlaps the target's p enough that
# drafts are accepted, over a reduced draft vocabulary (q scattered to target ids).
def _samples(llm, prompt, first_seed: int) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=first_seed + i,
                             ignore_eos=True) for i in range(NUM_REQUESTS)]
    outputs = llm.generate([prompt] * NUM_REQUESTS, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def sampling_setup(llama3_folder):
    prompt = random_prompts("eagle3-lossless", [6])[0]
    return prompt, _samples(make_llm(llama3_folder, max_num_seqs=256), prompt, 0)


def _sampled_with_head(folder, head, prompt):
    llm = _eagle_llm(folder, head, max_num_seqs=256)
    return llm, _samples(llm, prompt, NUM_REQUESTS)


def test_sampling_with_an_eagle3_head_matches_sampling_without(llama3_folder, heads,
                                                               sampling_setup):
    prompt, plain = sampling_setup
    llm, spec = _sampled_with_head(llama3_folder, heads("reduced"), prompt)
    c = _counters(llm)
    assert c.num_draft_tokens > 2000 and 100 < c.num_accepted_tokens < c.num_draft_tokens
    assert min(_p_values(plain, spec)) > P_MIN


def test_taking_the_head_s_drafts_unchecked_fails_the_same_test(llama3_folder, heads,
                                                                sampling_setup, monkeypatch):
    prompt, plain = sampling_setup
    monkeypatch.setattr("pagedserve.worker.model_runner.rejection_sample", accept_every_draft)
    _, spec = _sampled_with_head(llama3_folder, heads("reduced"), prompt)
    assert min(_p_values(plain, spec)) < 1e-12


def test_the_method_is_inferred_and_both_file_formats_and_an_own_table_load(
        llama3_folder, heads, tmp_path, monkeypatch):
    """A folder whose config names an EAGLE-3 head is ``eagle3`` without ``method``; the same
    tensors in safetensors draft the same tokens; a head with its own embedding table reads
    it (its drafts then differ)."""
    prompts = random_prompts("eagle3-formats", [8, 14])
    tensors = read_tensors(heads("reduced"))
    recorded = []
    original = EagleDrafter.propose

    def propose(drafter, scheduled, sampling):
        out = original(drafter, scheduled, sampling)
        recorded.append(out.token_ids.tolist())
        return out

    monkeypatch.setattr(EagleDrafter, "propose", propose)

    def drafts_of(head):
        recorded.clear()
        llm = make_llm(llama3_folder, speculative_config={"model": str(head),
                                                          "num_speculative_tokens": 3})
        llm.engine.speculation.step_times = FreeDrafts()
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        assert llm.engine.config.speculative_config.method == "eagle3"
        return list(recorded)

    from_bin = drafts_of(heads("reduced"))
    st = write_eagle3_head(tmp_path / "st", llama3_folder, fmt="safetensors", tensors=tensors)
    assert from_bin and drafts_of(st) == from_bin
    table = torch.randn(384, 64, generator=torch.Generator().manual_seed(5)) * 0.08
    own = write_eagle3_head(tmp_path / "own", llama3_folder,
                            tensors={**tensors, "embed_tokens.weight": table})
    assert drafts_of(own) != from_bin


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 400}, "vocabulary is 400"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, "auxiliary layers"),
    ({"target_hidden_size": 128}, "hidden states of 128"),
    ({"num_hidden_layers": 2}, "2 layers"),
    ({"architectures": ["LlamaForCausalLM"]}, "names"),
])
def test_a_head_that_does_not_fit_its_target_is_a_one_line_error(llama3_folder, tmp_path,
                                                                 change, message):
    import json

    head = write_eagle3_head(tmp_path / "head", llama3_folder)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=message) as error:
        make_llm(llama3_folder, speculative_config=_spec(head))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("edit, message", [
    ("missing", "lacks 1 tensors"),
    ("unknown", "not in its layout"),
    ("d2t", "outside the target's vocabulary"),
])
def test_a_head_with_bad_tensors_is_a_one_line_error(llama3_folder, heads, tmp_path, edit,
                                                     message):
    tensors = dict(read_tensors(heads("reduced")))
    if edit == "missing":
        del tensors["midlayer.hidden_norm.weight"]
    elif edit == "unknown":
        tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(1)
    else:
        tensors["d2t"] = tensors["d2t"] + 500
    head = write_eagle3_head(tmp_path / "head", llama3_folder, tensors=tensors)
    with pytest.raises(ConfigError, match=message) as error:
        make_llm(llama3_folder, speculative_config=_spec(head))
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_greedy_with_an_eagle3_head_under_tensor_parallelism(llama3_folder, heads):
    """TP=2 over gloo: the head runs on rank 0, reading rank 0's auxiliary hidden states."""
    prompts = random_prompts("eagle3-tp", [5, 17, 9])
    llm = _eagle_llm(llama3_folder, heads("reduced"), tensor_parallel_size=2)
    try:
        assert assert_greedy_matches(llm, hf_model(llama3_folder), prompts, new_tokens=16) \
            == len(prompts)
        assert _counters(llm).num_draft_tokens > 0
    finally:
        llm.shutdown()
