"""Speculative decoding with a draft model (``method: draft_model``; ``worker/drafter.py``):
greedy output equals transformers' own on random Llama and Qwen2 targets, with a draft that
agrees with the target often but not always (the target's weights plus noise) and with a
draft of another architecture, through prefix-cache hits, chunked prefill, swap and recompute
preemption, n=3 and TP=2; sampling stays distributed as without speculation (a two-sample
test, which a rule ignoring the draft's distribution fails); a bad draft is a one-line error.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from tests.engine.test_speculative import (
    MECHANISMS,
    assert_greedy_through_mechanism,
    assert_greedy_with_accepted_drafts_then_shut_down,
    assert_n_3_greedy_equals_one_and_seeded_repeats,
    mechanism_options,
    mechanism_prompts,
)
from tests.engine.test_speculative_lossless import (
    NUM_REQUESTS,
    P_MIN,
    FreeDrafts,
    _p_values,
    _samples,
    accept_every_draft,
)
from tests.kv_checks import assert_pools_full
from tests.tiny_models import (
    assert_greedy_matches,
    hf_model,
    make_llm,
    random_prompts,
    write_tiny_model,
)


def _noisy_copy(folder, out, scale: float, seed: int = 0):
    """The checkpoint of ``folder`` with Gaussian noise of std ``scale`` on every matrix (the
    weights' own std is 0.08; a random tiny model is chaotic enough that 0.004 already makes
    its draft wrong about a third of the time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    model.save_pretrained(out)
    _copy_tokenizer(folder, out)
    return out


def _copy_tokenizer(source, destination) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, destination / name)


@pytest.fixture(scope="module")
def drafts(tiny_model_folder, tmp_path_factory):
    """``drafts(arch)``: the noisy copy of that architecture's tiny checkpoint."""
    made = {}

    def draft(arch: str):
        if arch not in made:
            made[arch] = _noisy_copy(tiny_model_folder(arch),
                                     tmp_path_factory.mktemp(f"draft-{arch}"), 0.004)
        return made[arch]

    return draft


def _spec(draft, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def _draft_llm(folder, draft, **options):
    llm = make_llm(folder, speculative_config=_spec(draft), **options)
    llm.engine.speculation.step_times = FreeDrafts()  # what is drafted depends on no timing
    return llm


def _counters(llm):
    return llm.engine.speculation.counters


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_greedy_with_a_draft_model_equals_transformers(tiny_model_folder, drafts, arch):
    folder = tiny_model_folder(arch)
    prompts = random_prompts(f"draft-{arch}", [5, 17, 33, 9])
    llm = _draft_llm(folder, drafts(arch))
    assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=24) == len(prompts)
    c = _counters(llm)
    # The noisy draft is right often and wrong sometimes: both paths of the verify step ran.
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert c.mean_acceptance_length > 2.0
    assert_pools_full(llm.engine.kv)


def test_a_draft_of_another_architecture_leaves_greedy_output_unchanged(tiny_model_folder,
                                                                        tmp_path):
    folder = tiny_model_folder("llama3")
    prompts = random_prompts("other-arch", [7, 12])
    # The Qwen2 checkpoint with the target's tokenizer files (each tiny checkpoint trains its
    # own BPE, and training may order tied merges differently: the engine would refuse it).
    draft = shutil.copytree(tiny_model_folder("qwen2"), tmp_path / "qwen2-draft")
    _copy_tokenizer(folder, draft)
    llm = _draft_llm(folder, draft)
    assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=16) == len(prompts)
    assert _counters(llm).num_draft_tokens > 0
    assert_pools_full(llm.engine.kv)


@pytest.mark.parametrize("case", MECHANISMS)
def test_greedy_with_a_draft_model_through_the_engine_s_other_mechanisms(llama3_folder, drafts,
                                                                         case):
    prompts = mechanism_prompts(f"draft-{case}")
    # 16 of the target's blocks are 8 of the pair's (the draft has the target's shape).
    llm = _draft_llm(llama3_folder, drafts("llama3"), **mechanism_options(case, 16))
    assert_greedy_through_mechanism(llm, llama3_folder, prompts, case)
    # A stale draft cache would still give the target's tokens, but accept few drafts.
    assert _counters(llm).mean_acceptance_length > 2.0


def test_n_3_with_a_draft_model(llama3_folder, drafts):
    prompts = random_prompts("draft-n3", [7])
    llm = _draft_llm(llama3_folder, drafts("llama3"))
    assert_n_3_greedy_equals_one_and_seeded_repeats(llm, llama3_folder, prompts)
    assert _counters(llm).num_accepted_tokens > 0


@pytest.fixture(scope="module")
def sampling_setup(llama3_folder, tmp_path_factory):
    """A draft whose distribution differs clearly from the target's (more noise), and the
    target's own samples without speculation."""
    prompt = random_prompts("draft-lossless", [6])[0]
    draft = _noisy_copy(llama3_folder, tmp_path_factory.mktemp("far-draft"), 0.012, seed=1)
    plain = _samples(make_llm(llama3_folder, max_num_seqs=256), prompt, 0)
    return prompt, draft, plain


def _sampled_with_draft(folder, draft, prompt):
    llm = make_llm(folder, max_num_seqs=256,
                   speculative_config=_spec(draft, 3))
    llm.engine.speculation.step_times = FreeDrafts()
    return llm, _samples(llm, prompt, NUM_REQUESTS)


def test_sampling_with_a_draft_model_matches_sampling_without(llama3_folder, sampling_setup):
    prompt, draft, plain = sampling_setup
    llm, spec = _sampled_with_draft(llama3_folder, draft, prompt)
    c = _counters(llm)
    assert c.num_draft_tokens > 2000 and 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert min(_p_values(plain, spec)) > P_MIN


def test_taking_the_draft_s_tokens_unchecked_fails_the_same_test(llama3_folder, sampling_setup,
                                                                 monkeypatch):
    """Accepting every draft samples the draft's distribution, not the target's: the same test
    sees the difference (so the draft differs clearly, and the test can fail)."""
    prompt, draft, plain = sampling_setup
    monkeypatch.setattr("pagedserve.worker.model_runner.rejection_sample", accept_every_draft)
    _, spec = _sampled_with_draft(llama3_folder, draft, prompt)
    assert min(_p_values(plain, spec)) < 1e-12


def test_a_draft_with_another_vocabulary_is_a_one_line_error(llama3_folder, tmp_path):
    other = write_tiny_model(tmp_path / "v", "llama3", vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary"):
        make_llm(llama3_folder, speculative_config=_spec(other))


@pytest.mark.slow
def test_greedy_with_a_draft_model_under_tensor_parallelism(llama3_folder, drafts):
    """TP=2 over gloo: rank 0 draws the drafts and hands them to rank 1 before the target's
    forward pass, whose collectives need both."""
    prompts = random_prompts("draft-tp", [5, 17, 9])
    llm = _draft_llm(llama3_folder, drafts("llama3"), tensor_parallel_size=2)
    assert_greedy_with_accepted_drafts_then_shut_down(llm, llama3_folder, prompts)


def test_a_draft_with_another_tokenizer_is_a_one_line_error(llama3_folder, drafts, tmp_path):
    """Same vocabulary size, two ids swapped: the draft's tokens would mean other text."""
    import json

    other = tmp_path / "swapped"
    shutil.copytree(drafts("llama3"), other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="tokenizer") as error:
        make_llm(llama3_folder, speculative_config=_spec(other))
    assert "\n" not in str(error.value)


def test_default_model_as_its_own_draft_keeps_the_text_and_accepts(default_llm,
                                                                   default_model_folder):
    """The default model (its converted GGUF folder, read by the loader as the draft too) with
    real chat prompts: greedy text equals the engine's without speculation, and a draft equal
    to the target has its drafts accepted (float rounding between the draft's decode passes
    and the target's verify step may reject a few)."""
    from pagedserve import LLM
    from tests.engine.test_speculative import COPY_PROMPTS

    llm = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory_bytes=128 << 20,
              quantization="none",
              speculative_config=_spec(default_model_folder, 3))
    llm.engine.speculation.step_times = FreeDrafts()
    messages = [[{"role": "user", "content": p}] for p in COPY_PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = default_llm.chat(messages, params, use_tqdm=False)
    spec = llm.chat(messages, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert _counters(llm).mean_acceptance_length > 3.5
    llm.shutdown()
