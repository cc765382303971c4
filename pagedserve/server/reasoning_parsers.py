"""A chat output's reasoning apart from its answer (``--reasoning-parser``, vLLM's names), for
models that think between a start marker and an end marker before they answer: ``<think>`` and
``</think>`` (DeepSeek-R1, Qwen3), ``[THINK]`` and ``[/THINK]`` (Magistral), or Granite's plain
"Here is my thought process:" and "Here is my response:".

The split works on text, not token ids: the tags are single special tokens in some tokenizers
and several plain tokens in others. A stream passes on reasoning and content as they are
generated, holding back only what may be the start of a marker.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from pagedserve.server.stream_markers import held_back


class TagIds(NamedTuple):
    """The tags as a grammar that waits for the reasoning reads them (the fields
    ``reasoning_end_token_ids`` and ``reasoning_start_token_id`` of
    ``StructuredOutputsParams``)."""

    end: list[int]
    start: int | None  # None: the output begins inside the reasoning


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str | None  # None while the output is still reasoning


@dataclass(frozen=True)
class ThinkParser:
    """``implicit_start``: the output begins inside the reasoning (the chat template opened
    it), so a leading start marker is optional and an output without an end marker is all
    reasoning: vLLM's ``deepseek_r1``. Otherwise the output reasons only if it opens with a
    start marker, and is all content if it does not: ``qwen3`` (with ``enable_thinking=False``
    its template puts an empty think block in the prompt, and the output has no tags),
    ``mistral`` and ``granite``.

    ``starts`` and ``ends`` are the markers' spellings (Granite writes "Here's" as well as
    "Here is"); the first end marker of any spelling ends the reasoning.
    ``keeps_special_tokens``: the markers are special tokens, which a request then keeps in
    its text (``skip_special_tokens=False``), as the ``mistral`` tool parser's."""

    implicit_start: bool
    starts: tuple[str, ...] = ("<think>",)
    ends: tuple[str, ...] = ("</think>",)
    keeps_special_tokens: bool = False

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """The reasoning and content of an output; of a partial one (``finished`` False),
        what is surely each so far, holding back the end of ``text`` that may be part of a
        marker. As ``text`` grows, both only ever grow at their ends."""
        if not finished and self._may_open(text):
            return ReasoningSplit("", None)  # it may still open with a start marker
        start = next((s for s in self.starts if text.startswith(s)), None)
        if start is not None:
            body = text[len(start):]
        elif self.implicit_start:
            body = text
        else:
            return ReasoningSplit("", text)
        end = self._end(body)
        if end is not None:
            return ReasoningSplit(body[:end[0]], body[end[1]:])
        if not finished:
            body = body[:len(body) - max(held_back(body, e) for e in self.ends)]
        return ReasoningSplit(body, None)

    def _may_open(self, text: str) -> bool:
        """Whether ``text`` is a start marker's beginning, not yet all of it."""
        return any(s.startswith(text) and s != text for s in self.starts)

    def _end(self, body: str) -> tuple[int, int] | None:
        """Where the first end marker in ``body`` begins and ends; None if none is there."""
        found = [(i, i + len(e)) for e in self.ends if (i := body.find(e)) >= 0]
        return min(found, default=None)

    def _has_end(self, text: str) -> bool:
        return any(e in text for e in self.ends)

    def num_reasoning_tokens(self, token_ids: list[int],
                             decode: Callable[[list[int]], str]) -> int:
        """How many of an output's tokens are its reasoning, the end marker included: the
        fewest whose text holds an end marker; all of them if the reasoning never ended; none
        if the output does not reason. ``decode`` keeps special tokens. The end's token is
        found by bisection (a dozen decodes of a 4k-token output) as a marker of several
        tokens may end anywhere inside one."""
        text = decode(token_ids)
        if not self.implicit_start and not text.startswith(self.starts):
            return 0
        if not self._has_end(text):
            return len(token_ids)
        counts = range(1, len(token_ids) + 1)
        return counts[bisect.bisect_left(counts, True,
                                         key=lambda n: self._has_end(decode(token_ids[:n])))]

    def tag_ids(self, encode: Callable[[str], list[int]]) -> TagIds | None:
        """The tags' token ids; None where the engine cannot follow this parser by tokens:
        an end marker of several spellings, or an output that may or may not open with a
        start marker that is not one token (the grammar allows it as the first token besides
        its own)."""
        if len(self.ends) != 1:
            return None
        end = encode(self.ends[0])
        if self.implicit_start:
            return TagIds(end, None)
        start = [encode(s) for s in self.starts]
        return TagIds(end, start[0][0]) if len(start) == 1 and len(start[0]) == 1 else None


class ReasoningStream:
    """One streamed choice's reasoning: each call gives the reasoning not passed on before
    and the content so far (for the content's own stream, which may regroup it further)."""

    def __init__(self, parser: ThinkParser) -> None:
        self.parser = parser
        self.num_sent = 0  # characters of the reasoning passed on

    def update(self, text: str, finished: bool) -> ReasoningSplit:
        split = self.parser.split(text, finished)
        piece, self.num_sent = split.reasoning[self.num_sent:], len(split.reasoning)
        return ReasoningSplit(piece, split.content)


REASONING_PARSERS: dict[str, ThinkParser] = {
    "deepseek_r1": ThinkParser(implicit_start=True),
    "qwen3": ThinkParser(implicit_start=False),
    # Granite 3.2/3.3 with thinking on (chat_template_kwargs {"thinking": true}); some
    # quantized checkpoints write "Here's" (vLLM's parser takes both).
    "granite": ThinkParser(
        implicit_start=False,
        starts=("Here is my thought process:", "Here's my thought process:"),
        ends=("Here is my response:", "Here's my response:")),
    # Magistral and other Mistral models whose tokenizer has [THINK] and [/THINK] tokens.
    "mistral": ThinkParser(implicit_start=False, starts=("[THINK]",), ends=("[/THINK]",),
                           keeps_special_tokens=True),
}
