"""Each token's raw bytes, for chat logprobs' ``bytes``.

A token may hold part of a character (an emoji is several byte-level tokens), whose decoded
text is U+FFFD; OpenAI's ``bytes`` are the token's own bytes, so that the bytes of a choice's
tokens join to the UTF-8 of its content. Byte-level BPE (GPT-2, Llama 3, SmolLM) writes each
byte as one printable character; SentencePiece's byte fallback writes a byte as ``<0xF0>``;
any other token (added tokens, SentencePiece pieces) is taken as the UTF-8 of its text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode`` inverted (character's code point -> the byte it stands
    for, as ``str.translate`` reads it): printable Latin-1 bytes stand for themselves, the
    rest for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {b: chr(b) for b in printable}
    alphabet.update({256 + i: chr(b) for i, b in enumerate(others)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


class TokenBytes:
    """The bytes of every token of a tokenizer's vocabulary, computed once (tens of ms for a
    50k vocabulary) so that a request reads a list; built at start-up, never on the event
    loop, whose requests must not share the tokenizer with the tokenizer thread."""

    def __init__(self, tokenizer: Any) -> None:
        byte_level = _is_byte_level(tokenizer)
        added = tokenizer.added_tokens_decoder
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self._table = [None if piece is None or token in added else _piece_bytes(piece, byte_level)
                       for token, piece in enumerate(pieces)]

    def of(self, token: int, text: str) -> list[int]:
        """The bytes of ``token``, whose decoded text is ``text``."""
        raw = self._table[token] if 0 <= token < len(self._table) else None
        return list(text.encode() if raw is None else raw)


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the fast tokenizer's decoder (alone or in a sequence) is ByteLevel."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())  # a decoder pickles as its JSON
    return "ByteLevel" in {d.get("type") for d in [state, *state.get("decoders", [])]}


def _piece_bytes(piece: str, byte_level: bool) -> bytes | None:
    """The bytes a vocabulary piece stands for; None: the UTF-8 of its decoded text."""
    if byte_level:
        try:
            return piece.translate(_BYTE_LEVEL).encode("latin-1")
        except UnicodeEncodeError:  # a character outside the alphabet
            return None
    match = _BYTE_FALLBACK.fullmatch(piece)
    return bytes([int(match.group(1), 16)]) if match else None
