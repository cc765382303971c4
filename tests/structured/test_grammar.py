"""The grammar pieces without a model: spec checks, the device-side mask against a bit-by-bit
reference, padded vocabularies, speculative drafts walked through a matcher without advancing
it, and a constrained request crossing the process boundary."""

from __future__ import annotations

import msgspec
import pytest
import torch
import xgrammar as xgr

from pagedserve.engine import core_messages as msg
from pagedserve.sample.sampler import apply_grammar_mask
from pagedserve.sampling_params import (
    InvalidSamplingParam,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.structured.grammar_state import (
    GrammarMask,
    GrammarState,
    ReasoningGate,
    build_grammar_mask,
)
from pagedserve.structured.spec import check, grammar_spec


def test_mask_matches_a_bit_by_bit_reference():
    vocab = 100  # not a multiple of 32: the last word's spare bits must be ignored
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator)
    words = torch.randint(-2**31, 2**31 - 1, (2, 4), generator=generator, dtype=torch.int64)
    bitmask = words.to(torch.int32)
    rows = [1, 3]
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            word = int(words[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    masked = logits.clone()
    apply_grammar_mask(masked, GrammarMask(torch.tensor(rows), bitmask))
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched


def test_unconstrained_batch_builds_no_mask():
    assert build_grammar_mask([None, None], 128) is None


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


def test_padded_vocabulary_ids_are_never_allowed(tokenizer):
    """A model whose embedding is padded past the tokenizer: its extra logits columns must be
    masked, or the sampler could draw an id the tokenizer cannot decode."""
    from pagedserve.structured.compiler import GrammarCompilerPool

    padded = len(tokenizer) + 70
    pool = GrammarCompilerPool(tokenizer, padded, {tokenizer.eos_token_id}, num_workers=1,
                               timeout_s=60)
    compiled = pool.get(grammar_spec(StructuredOutputsParams(json_object=True))).result()
    mask = build_grammar_mask([None, GrammarState(compiled)], padded)
    assert mask.bitmask.shape == (1, -(-padded // 32))
    logits = torch.zeros(2, padded)
    apply_grammar_mask(logits, mask)
    assert torch.isinf(logits[1, len(tokenizer):]).all()
    assert torch.isfinite(logits[1, tokenizer.encode("{")[0]])  # a JSON object may start
    assert not torch.isinf(logits[0]).any()


def test_compiled_grammars_are_shared_and_the_cache_is_bounded(tokenizer, monkeypatch):
    from pagedserve.structured import compiler

    monkeypatch.setattr(compiler, "MAX_CACHED_GRAMMARS", 2)
    pool = compiler.GrammarCompilerPool(tokenizer, len(tokenizer), {tokenizer.eos_token_id},
                                        num_workers=1, timeout_s=60)
    specs = [grammar_spec(StructuredOutputsParams(regex=r)) for r in ("a", "b", "c")]
    first = pool.get(specs[0])
    assert pool.get(specs[0]) is first  # one compile for every request of a spec
    second = pool.get(specs[1])
    pool.get(specs[0])  # now the most recently asked
    pool.get(specs[2])  # evicts specs[1]
    assert pool.get(specs[0]) is first
    assert pool.get(specs[1]) is not second  # compiled again
    assert first.result() is not None and second.result() is not None


def test_choice_grammar_accepts_exactly_the_choices(tokenizer):
    from pagedserve.structured.compiler import GrammarCompilerPool

    choices = ['say "hi"', "back\\slash", "two\nlines", "ü€"]
    pool = GrammarCompilerPool(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, num_workers=1,
                               timeout_s=60)
    compiled = pool.get(grammar_spec(StructuredOutputsParams(choice=choices))).result()
    for text in [*choices, 'say "hi" ', "two"]:
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == (text in choices), text


def test_json_object_grammar_accepts_only_an_object(tokenizer):
    """OpenAI's json_object promises an object: a top-level array or scalar is refused (the
    builtin JSON grammar took ``[0.999]``), with the json_schema path's fixed whitespace."""
    from pagedserve.structured.compiler import GrammarCompilerPool

    pool = GrammarCompilerPool(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, num_workers=1,
                               timeout_s=60)
    compiled = pool.get(grammar_spec(StructuredOutputsParams(json_object=True))).result()
    objects = ['{"a": [1, true], "b": {"c": null}}', "{}"]
    others = ["[0.999]", "[true]", "3", '"s"', "null", '{"a":1}', '{ "a": 1}']
    for text in objects + others:
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == (text in objects), text


def _mask_of(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask[0]


def test_drafts_are_cut_and_masked_without_advancing_the_matcher(tokenizer):
    """``num_valid`` cuts drafts at the first the grammar refuses and before one that ends
    it; ``build_grammar_mask`` gives a verifying sequence one row per position, position j
    the mask of a fresh matcher fed the accepted tokens and the first j drafts, after the
    rows of the sequences before it; neither leaves the matcher anywhere else."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"[0-9]{3}")
    d = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    letter, eos = tokenizer.convert_tokens_to_ids("a"), tokenizer.eos_token_id
    vocab = len(tokenizer)
    state = GrammarState(compiled)
    assert state.accept(d[1])
    assert state.num_valid([d[2], letter, d[3]]) == 1  # refused
    assert state.num_valid([d[2], d[3], d[4]]) == 2  # a fourth digit is refused
    assert state.num_valid([d[2], d[3], eos]) == 2  # the end: the target emits it itself
    assert state.num_valid([eos]) == 0 and state.num_valid([]) == 0

    drafts = [[d[7]], [d[2], d[3]], []]  # a free row with one draft, ours, a free row
    mask = build_grammar_mask([None, state, None], vocab, drafts)
    assert mask.rows.tolist() == [2, 3, 4]
    for j in range(3):
        fresh = xgr.GrammarMatcher(compiled)
        assert all(fresh.accept_token(t) for t in [d[1], *drafts[1][:j]])
        assert torch.equal(mask.bitmask[j], _mask_of(fresh, vocab)), j
    assert not bool(mask.bitmask[2, d[5] // 32] >> (d[5] % 32) & 1)  # 3 digits: no fourth

    fresh = xgr.GrammarMatcher(compiled)
    assert fresh.accept_token(d[1])
    after = xgr.allocate_token_bitmask(1, vocab)
    state.fill(after, 0)
    assert torch.equal(after[0], _mask_of(fresh, vocab))  # the drafts left no trace
    with pytest.raises(RuntimeError, match="outside the grammar"):
        build_grammar_mask([state], vocab, [[letter]])
    state.fill(after, 0)
    assert torch.equal(after[0], _mask_of(fresh, vocab))  # nor did a refused one


def _allows(mask: torch.Tensor, token: int) -> bool:
    return bool(mask[token // 32] >> (token % 32) & 1)


def test_grammar_waits_for_the_reasoning_end_even_inside_drafts(tokenizer):
    """With a ``ReasoningGate`` the grammar masks nothing and takes no token until the output
    ends with the end ids (the last of them still free); drafts that cross the end are
    walked through the gate too and taken back with the matcher."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"[0-9]{3}")
    d = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    a, b, letter = (tokenizer.convert_tokens_to_ids(c) for c in "abx")
    vocab = len(tokenizer)
    state = GrammarState(compiled, ReasoningGate((a, b)))
    free = xgr.allocate_token_bitmask(1, vocab)
    free[0] = -1
    assert state.accept(letter) and state.accept(a) and not state.terminated
    # The end ids, then three digits, then the end: the grammar applies from the fourth.
    assert state.num_valid([b, d[1], d[2], letter]) == 3
    assert state.num_valid([letter, b, d[1]]) == 3  # a, letter, b: not the end
    drafts = [b, d[1], d[2]]
    mask = build_grammar_mask([state], vocab, [drafts])
    assert torch.equal(mask.bitmask[0], free[0])  # before b, the last of the end ids
    for j in (1, 2, 3):
        fresh = xgr.GrammarMatcher(compiled)
        assert all(fresh.accept_token(t) for t in drafts[1:j])
        assert torch.equal(mask.bitmask[j], _mask_of(fresh, vocab)), j
    row = xgr.allocate_token_bitmask(1, vocab)
    state.fill(row, 0)
    assert torch.equal(row[0], free[0])  # the walks left the gate and matcher as they were
    assert state.accept(b) and not state.accept(letter) and state.accept(d[0])

    # qwen3: the grammar applies from the start, unless the first token opens the reasoning.
    opened = GrammarState(compiled, ReasoningGate((b,), start_id=a))
    opened.fill(row, 0)
    assert _allows(row[0], a) and _allows(row[0], d[0]) and not _allows(row[0], letter)
    assert opened.accept(a) and opened.accept(letter) and opened.accept(b)
    assert not opened.accept(a) and opened.accept(d[5])
    direct = GrammarState(compiled, ReasoningGate((b,), start_id=a))
    assert direct.accept(d[1])
    direct.fill(row, 0)
    assert not _allows(row[0], a) and not direct.accept(a)


@pytest.mark.parametrize(("params", "words"), [
    (StructuredOutputsParams(json={"type": "objectx"}), ["json", "objectx"]),
    (StructuredOutputsParams(json="{not json"), ["json"]),
    (StructuredOutputsParams(regex="a[b"), ["regex", "["]),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), ["grammar", "undefined_rule"]),
])
def test_bad_specs_raise_with_the_library_message(params, words):
    with pytest.raises(InvalidSamplingParam) as info:
        check(grammar_spec(params), 1 << 16)
    assert info.value.param == "structured_outputs"
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message  # the library's source location is dropped


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]},
                                    {"json": {}, "json_object": True}, {"choice": []}])
def test_structured_outputs_needs_exactly_one_field(fields):
    with pytest.raises(InvalidSamplingParam):
        StructuredOutputsParams(**fields)


def test_beam_search_refuses_structured_outputs():
    with pytest.raises(InvalidSamplingParam, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex="a"))


def test_min_tokens_refuses_structured_outputs():
    with pytest.raises(InvalidSamplingParam) as info:
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a"))
    assert info.value.param == "min_tokens"


def test_constrained_params_cross_the_process_boundary():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    params = SamplingParams(structured_outputs={"json": schema})
    command = msg.AddRequests([msg.NewRequest("r", [1, 2], params)])
    decoded = msg.decode_command(msgspec.msgpack.encode(command))
    got = decoded.requests[0].params.structured_outputs
    assert isinstance(got, StructuredOutputsParams) and got.json == schema
    # Property order is kept: it is the order the grammar generates them in.
    assert grammar_spec(got).text.index('"b"') < grammar_spec(got).text.index('"a"')
