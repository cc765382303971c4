"""An ``LLM``'s life: a failed batch leaves nothing queued, and shutting an engine down (or
dropping it) leaves no rank, process group or Ray connection behind, so tensor-parallel
engines can follow one another in one process."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch.distributed as dist

from pagedserve import BeamSearchParams, SamplingParams
from tests.kv_checks import assert_pools_full
from tests.tiny_models import make_llm, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts("lifecycle", [5, 11])
# Long enough that a leftover request would be noticed: far more steps than the test runs.
LONG = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama3_folder):
    return make_llm(llama3_folder)


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    return _tokens(llm, PROMPTS, GREEDY)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def _assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished
    assert_pools_full(engine.kv)


# ---- a failed batch -----------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda llm: llm.generate([PROMPTS[0], ""], LONG, use_tqdm=False),
    lambda llm: llm.generate(PROMPTS, [LONG, SamplingParams(n=10**4)], use_tqdm=False),
    lambda llm: llm.beam_search([PROMPTS[0], []], BeamSearchParams(beam_width=2, max_tokens=500)),
], ids=["empty-prompt", "more-samples-than-max-num-seqs", "beam-search"])
def test_a_batch_with_one_bad_request_queues_none_of_it(llm, expected, call):
    with pytest.raises(ValueError):
        call(llm)
    _assert_idle(llm.engine)
    assert _tokens(llm, PROMPTS, GREEDY) == expected


def test_a_failure_while_queueing_takes_back_what_was_queued(llm, expected, monkeypatch):
    """Every request was valid, but queueing the second failed (here: the scheduler)."""
    scheduler = llm.engine.scheduler
    add_group, calls = scheduler.add_group, []

    def fail_second(group):
        calls.append(group)
        if len(calls) == 2:
            raise RuntimeError("queueing failed")
        add_group(group)

    monkeypatch.setattr(scheduler, "add_group", fail_second)
    with pytest.raises(RuntimeError, match="queueing failed"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    monkeypatch.undo()
    _assert_idle(llm.engine)
    assert _tokens(llm, PROMPTS, GREEDY) == expected


def test_an_interrupt_while_running_aborts_the_batch(llm, expected, monkeypatch):
    step, steps = llm.engine.step, []

    def interrupted_step():
        steps.append(None)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    monkeypatch.undo()
    _assert_idle(llm.engine)
    assert _tokens(llm, PROMPTS, GREEDY) == expected


# ---- shutdown -----------------------------------------------------------------------------
def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_left_nothing(children_before: set[int]) -> None:
    assert _children() <= children_before
    assert not dist.is_initialized()


def test_shutdown_is_idempotent_and_a_with_block_calls_it(llama3_folder):
    with make_llm(llama3_folder) as llm:
        assert _tokens(llm, PROMPTS[:1], GREEDY)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_tensor_parallel_engines_one_after_another(llama3_folder, expected, monkeypatch):
    """mp, then ray (whose local cluster the engine starts, and stops), then mp again, in one
    process: each gives one rank's tokens, and each shutdown leaves nothing running."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = _children()
    for backend in ("mp", "ray", "mp"):
        llm = make_llm(llama3_folder, tensor_parallel_size=2,
                       distributed_executor_backend=backend)
        assert _tokens(llm, PROMPTS, GREEDY) == expected, backend
        llm.shutdown()
        _assert_left_nothing(before)
        assert not ray.is_initialized()


@pytest.mark.slow
def test_dropping_a_tensor_parallel_llm_shuts_it_down(llama3_folder):
    before = _children()
    llm = make_llm(llama3_folder, tensor_parallel_size=2)
    assert _children() - before  # rank 1's process
    del llm
    gc.collect()
    _assert_left_nothing(before)


# ---- the forms a prompt, its parameters and a conversation may take ------------------------
def test_vllm_dict_prompts_are_read(llm, expected):
    dicts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert _tokens(llm, dicts, GREEDY) == expected
    text = llm.get_tokenizer().decode(PROMPTS[0])
    assert _tokens(llm, {"prompt": text}, GREEDY) == _tokens(llm, text, GREEDY)
    _assert_idle(llm.engine)


@pytest.mark.parametrize("call,error", [
    (lambda llm: llm.generate([b"hi"], GREEDY, use_tqdm=False), "a prompt must be"),
    (lambda llm: llm.generate(5, GREEDY, use_tqdm=False), "prompts must be"),
    (lambda llm: llm.generate([{"prompt_ids": [1]}], GREEDY, use_tqdm=False),
     "prompt key 'prompt_ids' is not supported"),
    (lambda llm: llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False), "sampling_params"),
    (lambda llm: llm.chat("hello", GREEDY, use_tqdm=False), "messages must be"),
], ids=["bytes", "int", "unknown-dict", "params-dict", "chat-str"])
def test_a_prompt_or_argument_of_the_wrong_type_is_a_type_error(llm, call, error):
    with pytest.raises(TypeError, match=error):
        call(llm)
    _assert_idle(llm.engine)


def test_chat_on_a_model_without_a_chat_template_says_so(llm):
    """transformers' own error spoke of tokenizer.chat_template and a template argument that
    LLM.chat does not take."""
    with pytest.raises(ValueError, match="^LLM.chat: the model .* has no chat template; pass "
                                         "chat_template=, or use LLM.generate"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    _assert_idle(llm.engine)


@pytest.mark.parametrize("width", [0, 2.5, True])
def test_beam_width_is_checked_by_its_own_name(llm, width):
    with pytest.raises(ValueError, match="beam_width must be an integer of at least 1"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=width, max_tokens=2))


def test_beam_width_of_any_integer_type(llm):
    """A numpy integer, as SamplingParams' integer fields take (it was refused as 'must be an
    integer ... got 2')."""
    import numpy as np

    by_numpy = llm.beam_search([PROMPTS[0]], BeamSearchParams(np.int64(2), 2))
    by_int = llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 2))
    assert [s.tokens for s in by_numpy[0].sequences] == [s.tokens for s in by_int[0].sequences]
    assert len(by_int[0].sequences) == 2


def test_beam_search_takes_vllms_params_only_at_temperature_0(llm):
    """The beams score raw log-probabilities (HF's rule); vLLM's old positional form is a
    TypeError naming what it takes."""
    with pytest.raises(ValueError, match="temperature must be 0, got 0.7"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 2, temperature=0.7))
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], 2)
    _assert_idle(llm.engine)


def test_chat_content_parts_are_joined_and_bad_messages_named():
    from pagedserve.entrypoints.llm import _template_messages

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert _template_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "a\nb"}]
    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert _template_messages([calls]) == [calls]
    for bad, error in (({"role": "user"}, r"messages\[0\] has no content"),
                       ("hi", r"messages\[0\] must be a dict"),
                       ({"role": "user", "content": [{"type": "image_url"}]},
                        "content parts must be"),
                       ({"role": "user", "content": 3}, "must be a str")):
        with pytest.raises(ValueError, match=error):
            _template_messages([bad])


# ---- use_tqdm as vLLM takes it: a flag, or a tqdm-like class to build the bar with --------
def test_use_tqdm_may_be_the_bar_class_to_use(llm, expected):
    from tqdm import tqdm

    bars, updates = [], []

    class Recording(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, disable=True, **kwargs)
            bars.append(self)

        def update(self, n=1):
            updates.append(n)

    assert [c.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=Recording)
            for c in o.outputs] == expected
    assert len(bars) == 1 and bars[0].total == len(PROMPTS) and sum(updates) == len(PROMPTS)
    with pytest.raises(TypeError, match="use_tqdm must be a bool or a tqdm-like callable"):
        llm.generate(PROMPTS, GREEDY, use_tqdm="yes")  # type: ignore[arg-type]
    _assert_idle(llm.engine)


def test_a_progress_callback_that_raises_aborts_the_batch(llm, expected):
    from tqdm import tqdm

    class Failing(tqdm):
        def update(self, n=1):
            raise RuntimeError("progress callback failed")

    with pytest.raises(RuntimeError, match="progress callback failed"):
        llm.generate(PROMPTS, LONG, use_tqdm=lambda **kwargs: Failing(disable=True, **kwargs))
    _assert_idle(llm.engine)
    assert _tokens(llm, PROMPTS, GREEDY) == expected


def test_token_ids_may_be_numpy_integers(llm, expected):
    """``list(np.array(ids))`` holds numpy integers, which SamplingParams' stop_token_ids
    already took; a prompt of them was refused as not a list of token ids."""
    import numpy as np

    prompts = [{"prompt_token_ids": list(np.array(p))} for p in PROMPTS]
    assert _tokens(llm, prompts, GREEDY) == expected
    out = llm.generate([list(np.array(PROMPTS[0], dtype=np.int32))], GREEDY, use_tqdm=False)
    assert type(out[0].prompt_token_ids[0]) is int



@pytest.mark.parametrize("prompt, key", [
    ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
    ({"prompt_token_ids": [5], "cache_salt": "a"}, "cache_salt"),
])
def test_a_prompt_dict_key_pagedserve_lacks_is_named(llm, prompt, key):
    with pytest.raises(TypeError, match=f"prompt key {key!r} is not supported"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
