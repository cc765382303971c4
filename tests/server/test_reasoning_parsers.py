"""The reasoning parsers on whole outputs, and streamed: cut at every point (a tag split across
deltas) and a character at a time, the pieces add up to the whole output's split, and nothing
is held back that cannot be part of a tag."""

from __future__ import annotations

import pytest

from pagedserve.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream

# (parser, model output, expected reasoning, expected content: None while never answered)
OUTPUTS = [
    # DeepSeek-R1-Distill-Llama: the template opened <think>, the output closes it.
    ("deepseek_r1", "Okay, 9.8 > 9.11.\n</think>\n\n9.8 is greater.", "Okay, 9.8 > 9.11.\n",
     "\n\n9.8 is greater."),
    # An older template: the model opens <think> itself.
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\nYes.", "\nHmm.\n", "\n\nYes."),
    # Cut short by max_tokens inside the reasoning: all of it is reasoning.
    ("deepseek_r1", "Let me think about 2 < 3 and </thi", "Let me think about 2 < 3 and </thi",
     None),
    ("deepseek_r1", "<think></think>The answer.", "", "The answer."),
    ("deepseek_r1", "</think>", "", ""),
    ("deepseek_r1", "", "", None),
    ("deepseek_r1", "<thin", "<thin", None),
    # Only the first </think> ends the reasoning.
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    # Qwen3 with thinking on: it opens <think> itself.
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "\n\nHello!"),
    # enable_thinking=False: the empty block is in the prompt; the output has no tags.
    ("qwen3", "Hello! How can I help?", "", "Hello! How can I help?"),
    ("qwen3", "x</think>y", "", "x</think>y"),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "", "", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), OUTPUTS)
def test_whole_output(name, text, reasoning, content):
    assert tuple(REASONING_PARSERS[name].split(text)) == (reasoning, content)


def _streamed(name: str, pieces: list[str]) -> tuple[str, str | None]:
    """The reasoning and the content so far after each cumulative text in turn."""
    stream, reasoning, content = ReasoningStream(REASONING_PARSERS[name]), "", None
    for i in range(len(pieces)):
        piece, so_far = stream.update("".join(pieces[:i + 1]), finished=i == len(pieces) - 1)
        reasoning += piece
        if so_far is not None:
            assert content is None or so_far.startswith(content)  # content only grows
            content = so_far
    return reasoning, content


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), OUTPUTS)
def test_cut_anywhere_the_stream_adds_up_to_the_whole(name, text, reasoning, content):
    for cut in range(len(text) + 1):
        assert _streamed(name, [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert _streamed(name, [*text, ""]) == (reasoning, content)


@pytest.mark.parametrize(("text", "sent"), [
    ("Let me see <", "Let me see "),
    ("Let me see </thin", "Let me see "),
    ("Let me see </b", "Let me see </b"),  # no tag starts so
    ("<think", ""),
    ("<think>Hi", "Hi"),
    ("<thinking", "<thinking"),  # no <think> tag after all: reasoning from the start
    ("a</think>b", "a"),
])
def test_a_stream_holds_back_only_what_may_be_a_tag(text, sent):
    piece, _ = ReasoningStream(REASONING_PARSERS["deepseek_r1"]).update(text, finished=False)
    assert piece == sent


def test_qwen3_content_streams_once_no_think_tag_can_open():
    stream = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert stream.update("<th", finished=False) == ("", None)
    assert stream.update("<tho", finished=False) == ("", "<tho")
