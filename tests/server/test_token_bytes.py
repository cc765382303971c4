"""Chat logprobs' ``bytes``: each token's raw bytes, so that a character split over several
tokens (whose texts are each U+FFFD) joins back to its UTF-8."""

from __future__ import annotations

import pytest

from pagedserve.server.token_bytes import TokenBytes

TEXT = "naïve 日本 🚀✨ <|im_end|>"


@pytest.fixture(scope="module")
def smol_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


def test_byte_level_tokens_join_to_the_utf8(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [smol_tokenizer.decode([t]) for t in ids]
    assert "\ufffd" in texts  # the emoji is split over tokens that decode to nothing whole
    token_bytes = TokenBytes(smol_tokenizer)
    got = [token_bytes.of(t, text) for t, text in zip(ids, texts, strict=True)]
    assert b"".join(map(bytes, got)) == TEXT.encode()
    rocket = smol_tokenizer.encode("🚀", add_special_tokens=False)
    assert b"".join(bytes(token_bytes.of(t, "\ufffd")) for t in rocket) == "🚀".encode()


def test_an_id_past_the_vocabulary_is_its_text(smol_tokenizer):
    assert TokenBytes(smol_tokenizer).of(len(smol_tokenizer) + 5, "é") == [0xC3, 0xA9]


def _byte_fallback_tokenizer():
    """A SentencePiece-style BPE: "▁" for spaces, bytes it has no piece for as <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "é", "hé", "▁hé"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)},
                               merges=[("h", "é"), ("▁", "hé")], unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_byte_fallback_tokens_are_their_byte():
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode(" hé🚀", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["▁hé", "<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    token_bytes = TokenBytes(tokenizer)
    # A piece that is no byte is the UTF-8 of its text (not Latin-1: "é" is two bytes).
    assert token_bytes.of(ids[0], " hé") == list(" hé".encode())
    assert b"".join(bytes(token_bytes.of(t, "\ufffd")) for t in ids[1:]) == "🚀".encode()
