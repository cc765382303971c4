"""The output stage appends a list of tokens per sequence, one token at a time: a stop
mid-list (stop string, EOS, max_tokens) drops the tokens after it, and the request ends as it
would have, had the tokens come one step at a time."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.sequence import SequenceStatus
from pagedserve.engine.input_processor import InputLimits, InputProcessor
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.step import HostSamples, StepOutput, StepResult
from tests.tiny_models import VOCAB, _train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer()


def _start(tokenizer, params):
    eos = tokenizer.eos_token_id
    limits = InputLimits(vocab_size=VOCAB, max_model_len=512, max_num_seqs=4,
                         eos_token_ids=frozenset({eos}), num_kv_blocks=64, block_size=16,
                         max_grammar_bytes=1 << 20, max_logprobs=20)
    state = InputProcessor(tokenizer, limits).process(
        "r", "the quick", params)

    def finish(seq, status: SequenceStatus) -> None:
        seq.status = status

    def take_back(seq, num_tokens: int) -> None:
        taken_back.append(num_tokens)

    taken_back: list[int] = []
    outputs = OutputProcessor(finish, take_back, beams=None)
    outputs.taken_back = taken_back
    outputs.add(state)
    return outputs, state


def _step(outputs, state, tokens):
    """Apply one step in which the request's sequence sampled ``tokens``, with logprobs (a
    function of the token, so one list and one token a step give the same)."""
    ids = torch.tensor([tokens])
    logprobs = -(ids % 7).float() - 1
    samples = HostSamples(ids.tolist(), logprobs.tolist(), (ids % 3 + 1).tolist(),
                          ids.unsqueeze(2).tolist(), logprobs.unsqueeze(2).tolist())
    result = StepResult(0, [state.seqs[0].seq], [len(tokens)])
    return outputs.process(result, StepOutput(samples, {}))


def _final(output):
    c = output.outputs[0]
    return c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob


def _one_at_a_time(tokenizer, params, tokens):
    outputs, state = _start(tokenizer, params)
    for token in tokens:
        final = _step(outputs, state, [token])
        if state.finished:
            return _final(final[0])
    raise AssertionError("the reference never stopped")


def _as_one_list(tokenizer, params, tokens):
    outputs, state = _start(tokenizer, params)
    final = _step(outputs, state, tokens)
    return _final(final[0]), state


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("case", ["stop_string", "eos", "max_tokens", "eos_before_min_tokens",
                                  "stop_token"])
def test_a_stop_mid_list_drops_what_follows_as_one_token_a_step_would(tokenizer, case):
    eos = tokenizer.eos_token_id
    words = _encode(tokenizer, " brown fox jumps over the lazy dog")
    tokens, params = {
        "stop_string": (words, SamplingParams(stop=["jumps"], max_tokens=50, logprobs=1)),
        "eos": (words[:2] + [eos] + words[2:], SamplingParams(max_tokens=50, logprobs=1)),
        "max_tokens": (words, SamplingParams(max_tokens=3, logprobs=1)),
        "eos_before_min_tokens": ([eos, *words[:2], eos, *words[2:]],
                                  SamplingParams(max_tokens=50, min_tokens=2, logprobs=1)),
        "stop_token": (words, SamplingParams(stop_token_ids=[words[3]], max_tokens=50,
                                             logprobs=1)),
    }[case]
    expected = _one_at_a_time(tokenizer, params, tokens)
    got, state = _as_one_list(tokenizer, params, tokens)
    assert got == expected
    kept = len(expected[1])
    assert 0 < kept < len(tokens)  # the stop is mid-list
    assert state.seqs[0].seq.output_token_ids == tokens[:kept]
    assert state.metrics.num_generated_tokens == kept


def test_append_tokens_reports_the_dropped_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    words = _encode(tokenizer, " brown fox jumps")
    tokens = [words[0], eos, *words[1:]]
    outputs, state = _start(tokenizer, SamplingParams(max_tokens=50))
    rows = HostSamples([tokens], None, None, None, None)
    assert outputs.append_tokens(state.seqs[0], rows, 0, len(tokens)) == len(tokens) - 2
    outputs, state = _start(tokenizer, SamplingParams(max_tokens=50))
    assert outputs.append_tokens(state.seqs[0], rows, 0, 1) == 0  # no stop: nothing dropped


def test_a_list_without_a_stop_is_the_tokens_one_step_each(tokenizer):
    words = _encode(tokenizer, " hello world, paged attention")
    params = SamplingParams(max_tokens=50, logprobs=1)
    outputs, state = _start(tokenizer, params)
    ref_outputs, ref_state = _start(tokenizer, params)
    for token in words:
        (expected,) = _step(ref_outputs, ref_state, [token])
    (got,) = _step(outputs, state, words)
    assert _final(got) == _final(expected)
    assert got.outputs[0].finish_reason is None


def test_a_verify_row_appends_its_emitted_tokens_and_gives_back_the_rejected_slots(tokenizer):
    """A row that sampled at 4 positions but output 2 tokens (one draft accepted, then the
    target's token): 2 are appended and the 2 rejected drafts' slots go back to the core; a
    row that stops inside its emitted tokens gives nothing back (its blocks are freed)."""
    words = _encode(tokenizer, " brown fox jumps over")
    outputs, state = _start(tokenizer, SamplingParams(max_tokens=50))
    seq = state.seqs[0].seq
    rows = HostSamples([words[:2] + [-1, -1]], None, None, None, None, counts=[2])
    outputs.process(StepResult(0, [seq], [4]), StepOutput(rows, {}))
    assert seq.output_token_ids == words[:2] and outputs.taken_back == [2]
    stop = words[1]
    outputs, state = _start(tokenizer, SamplingParams(max_tokens=50, stop_token_ids=[stop]))
    seq = state.seqs[0].seq
    outputs.process(StepResult(0, [seq], [4]), StepOutput(rows, {}))
    assert seq.output_token_ids == words[:2] and state.finished and outputs.taken_back == []
