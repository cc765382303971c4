"""Incremental detokenization against full decodes with real (offline-trained) tokenizers."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキスト、東京タワー。中文字符测试。",
    "Emoji: 😀🎉🚀 👍🏽 family 👨‍👩‍👧",
    "naïve café résumé — “quotes” ümlaut",
    "stop here STOP there, done.\n\nnew paragraph",
] * 3


@cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE; a small vocabulary splits multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece style: a decode drops the leading space of its first word."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world again and again, hello there world"] * 3,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"],
                                                show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def encode(text: str) -> list[int]:
    return byte_level_tokenizer().encode(text, add_special_tokens=False)


def run(ids, prompt=(), **params):
    """Feed ids until a stop string hits; returns (detokenizer, deltas incl. the flush)."""
    detok = IncrementalDetokenizer(byte_level_tokenizer(), list(prompt), SamplingParams(**params))
    deltas = []
    for token_id in ids:
        deltas.append(detok.append(token_id))
        assert detok.text == "".join(deltas)
        if detok.stop_reason is not None:
            return detok, deltas
    deltas.append(detok.flush())
    return detok, deltas


token_ids = st.lists(st.integers(0, 399), max_size=40)


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 399), max_size=8), out=token_ids, skip=st.booleans())
def test_deltas_join_to_the_full_decode(prompt, out, skip):
    detok, deltas = run(out, prompt, skip_special_tokens=skip)
    full = byte_level_tokenizer().decode(out, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas)


def test_split_characters_are_held_back_until_complete():
    ids = encode("😀東")
    assert len(ids) > 2  # the tokenizer really splits these characters across tokens
    _, deltas = run(ids)
    assert "".join(deltas) == "😀東"
    assert all(d in ("", "😀", "東", "😀東") for d in deltas)


def test_skip_special_tokens():
    ids = encode("Hello") + [0] + encode(" world")
    assert "".join(run(ids)[1]) == "Hello world"
    assert "".join(run(ids, skip_special_tokens=False)[1]) == "Hello<|endoftext|> world"


@settings(max_examples=300, deadline=None)
@given(out=st.lists(st.integers(0, 399), min_size=1, max_size=30), data=st.data(),
       include=st.booleans())
def test_stop_string_cuts_the_text(out, data, include):
    full = byte_level_tokenizer().decode(out, skip_special_tokens=True)
    if not full:
        return
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:start + data.draw(st.integers(1, 6))]
    index = full.find(stop)
    expected = full[:index + len(stop)] if include else full[:index]

    detok, deltas = run(out, stop=[stop], include_stop_str_in_output=include)
    assert detok.stop_reason == stop
    assert "".join(deltas) == detok.text == expected
    for i in range(len(deltas)):  # no delta ever runs past the cut
        assert expected.startswith("".join(deltas[:i + 1]))


def test_stop_string_spanning_tokens():
    ids = encode("Hello world, done")
    assert len(encode("Hello wo")) > 1
    detok, deltas = run(ids, stop=["o wo"])
    assert detok.text == "Hell" and detok.stop_reason == "o wo"
    assert len(deltas) < len(ids)  # stopped at the token completing the stop string
    assert detok.append(encode("x")[0]) == "" and detok.text == "Hell"
    detok, _ = run(ids, stop=["o wo"], include_stop_str_in_output=True)
    assert detok.text == "Hello wo"


def test_stop_strings_count_only_from_min_tokens_on():
    """A stop string ending in the text of the first min_tokens - 1 tokens is not searched
    again later: the text the client required stays, and the first stop after it cuts (vLLM's
    rule). One that ends in the min_tokens-th token's text counts."""
    ids = encode(" 5, 6, 7,")
    tok = byte_level_tokenizer()
    # Tokens it takes to reach the first, second and third comma.
    reach = [next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).count(",") == c)
             for c in (1, 2, 3)]
    detok, _ = run(ids, stop=[","], min_tokens=reach[0])
    assert (detok.text, detok.stop_reason) == (" 5", ",")
    detok, _ = run(ids, stop=[","], min_tokens=reach[0] + 1)
    assert (detok.text, detok.stop_reason) == (" 5, 6", ",")
    detok, deltas = run(ids, stop=[","], min_tokens=reach[2])
    assert detok.text == " 5, 6, 7" and "".join(deltas) == detok.text


def test_earliest_stop_wins_whatever_the_list_order():
    ids = encode("Hello world")
    for stops in (["o w", " w"], [" w", "o w"]):
        detok, _ = run(ids, stop=stops)
        assert (detok.text, detok.stop_reason) == ("Hell", "o w")


def test_lookback_is_held_until_flush():
    detok, deltas = run(encode("Hello world"), stop=["zzz"])
    assert detok.stop_reason is None
    assert "".join(deltas[:-1]) == "Hello wor" and deltas[-1] == "ld"


def test_first_token_keeps_its_space_after_a_prompt():
    tok = metaspace_tokenizer()
    prompt = tok.encode("hello world")
    out = tok.encode(" again and", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    text = "".join(detok.append(t) for t in out) + detok.flush()
    # What the client sees appended to its prompt, not decode(out) == "again and".
    assert text == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " again and"


def test_decode_token():
    detok = IncrementalDetokenizer(byte_level_tokenizer(), [], SamplingParams())
    assert detok.decode_token(0) == "<|endoftext|>"
    assert detok.decode_token(encode(" world")[-1]) == byte_level_tokenizer().decode(
        encode(" world")[-1:])
