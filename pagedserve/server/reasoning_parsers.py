"""A chat output's reasoning apart from its answer (``--reasoning-parser``, vLLM's names), for
models that think between ``<think>`` and ``</think>`` before they answer.

The split works on text, not token ids: the tags are single special tokens in some tokenizers
and several plain tokens in others. A stream passes on reasoning and content as they are
generated, holding back only what may be the start of a tag.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from pagedserve.server.stream_markers import held_back

START, END = "<think>", "</think>"


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
    it), so a leading ``<think>`` is optional and an output without ``</think>`` is all
    reasoning: vLLM's ``deepseek_r1``. Otherwise the output reasons only if it opens with
    ``<think>``, and is all content if it does not: ``qwen3`` (with ``enable_thinking=False``
    its template puts an empty think block in the prompt, and the output has no tags)."""

    implicit_start: bool

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """The reasoning and content of an output; of a partial one (``finished`` False),
        what is surely each so far, holding back the end of ``text`` that may be part of a
        tag. As ``text`` grows, both only ever grow at their ends."""
        if not finished and START.startswith(text) and text != START:
            return ReasoningSplit("", None)  # it may still open with <think>
        if text.startswith(START):
            body = text[len(START):]
        elif self.implicit_start:
            body = text
        else:
            return ReasoningSplit("", text)
        reasoning, tag, content = body.partition(END)
        if tag:
            return ReasoningSplit(reasoning, content)
        if not finished:
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, END)]
        return ReasoningSplit(reasoning, None)

    def num_reasoning_tokens(self, token_ids: list[int],
                             decode: Callable[[list[int]], str]) -> int:
        """How many of an output's tokens are its reasoning, the end tag included: the fewest
        whose text holds the end tag; all of them if the reasoning never ended; none if the
        output does not reason. The end's token is found by bisection (a dozen decodes of a
        4k-token output) as a tag of several tokens may end anywhere inside one."""
        text = decode(token_ids)
        if not self.implicit_start and not text.startswith(START):
            return 0
        if END not in text:
            return len(token_ids)
        counts = range(1, len(token_ids) + 1)
        return counts[bisect.bisect_left(counts, True, key=lambda n: END in decode(token_ids[:n]))]

    def tag_ids(self, encode: Callable[[str], list[int]]) -> TagIds | None:
        """The tags' token ids; None where the engine cannot follow this parser by tokens:
        an output that may or may not open with ``<think>`` needs it as one token (the
        grammar allows it as the first token besides its own)."""
        end = encode(END)
        if self.implicit_start:
            return TagIds(end, None)
        start = encode(START)
        return TagIds(end, start[0]) if len(start) == 1 else None


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
}

