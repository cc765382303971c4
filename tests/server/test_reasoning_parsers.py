"""The reasoning parsers on whole outputs, and streamed: cut at every point (a tag split across
deltas) and a character at a time, the pieces add up to the whole output's split, and nothing
is held back that cannot be part of a tag."""

from __future__ import annotations

import pytest

from pagedserve.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream, ThinkParser

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
    # Granite 3.2/3.3 with thinking on: plain-text markers, in either spelling.
    ("granite", "Here is my thought process:\nCompare the tenths.\nHere is my response:\n9.8.",
     "\nCompare the tenths.\n", "\n9.8."),
    ("granite", "Here's my thought process: a Here's my response: b", " a ", " b"),
    ("granite", "Here is my thought process: a Here's my response: b", " a ", " b"),
    ("granite", "Here's my thought process: a Here is my response: b", " a ", " b"),
    # "Here" inside the reasoning that is no marker stays reasoning.
    ("granite", "Here is my thought process: Here is a plan. Here's my response: Done.",
     " Here is a plan. ", " Done."),
    ("granite", "Here is my thought process:Here is my response:", "", ""),
    ("granite", "Here is my thought process: a Here is my response: b Here is my response: c",
     " a ", " b Here is my response: c"),
    ("granite", "Here is my thought process: a Here's my response: b Here is my response: c",
     " a ", " b Here is my response: c"),
    # Thinking off: no markers, all content; a marker that does not open the output is text.
    ("granite", "9.8 is greater.", "", "9.8 is greater."),
    ("granite", "Sure. Here is my thought process: x Here is my response: y", "",
     "Sure. Here is my thought process: x Here is my response: y"),
    ("granite", "Here is my response: y", "", "Here is my response: y"),
    ("granite", "Here is my thought process: cut short", " cut short", None),
    ("granite", "Here is my thought process: cut at Here is my res", " cut at Here is my res",
     None),
    ("granite", "Here is my", "", "Here is my"),
    ("granite", "", "", ""),
    # Magistral: [THINK] and [/THINK] are special tokens, kept in the text.
    ("mistral", "[THINK]Compare the tenths.[/THINK]9.8 is greater.", "Compare the tenths.",
     "9.8 is greater."),
    ("mistral", "[THINK][/THINK]Yes.", "", "Yes."),
    ("mistral", "[THINK]cut short", "cut short", None),
    ("mistral", "[THINK]a[/THINK]b[/THINK]c", "a", "b[/THINK]c"),
    ("mistral", "9.8 is greater.", "", "9.8 is greater."),
    ("mistral", "x[/THINK]y", "", "x[/THINK]y"),
    ("mistral", "<think>a</think>b", "", "<think>a</think>b"),
    ("mistral", "[THI", "", "[THI"),
    ("mistral", "", "", ""),
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


@pytest.mark.parametrize(("text", "sent"), [
    ("Here is my thought process: I see. Here", " I see. "),
    ("Here is my thought process: I see. Here's my", " I see. "),
    ("Here is my thought process: I see. Here is my resp", " I see. "),
    ("Here is my thought process: I see. Here it is", " I see. Here it is"),
    ("Here's my thought process: a", " a"),
    ("Here is my thought process: a Here is my response: b", " a "),
])
def test_a_granite_stream_holds_back_only_what_may_be_a_marker(text, sent):
    piece, _ = ReasoningStream(REASONING_PARSERS["granite"]).update(text, finished=False)
    assert piece == sent


@pytest.mark.parametrize(("name", "held", "broken"), [
    ("granite", "Here'", "Here'd"), ("granite", "Here is my", "Here is me"),
    ("mistral", "[THIN", "[THINg")])
def test_content_streams_once_no_start_marker_can_open(name, held, broken):
    stream = ReasoningStream(REASONING_PARSERS[name])
    assert stream.update(held, finished=False) == ("", None)
    assert stream.update(broken, finished=False) == ("", broken)


def _encode(text: str) -> list[int]:
    """Each of Magistral's markers one token, anything else a token a character."""
    return {"[THINK]": [5], "[/THINK]": [6]}.get(text, [1] * len(text))


@pytest.mark.parametrize(("name", "ids"), [
    ("mistral", ([6], 5)), ("qwen3", None), ("deepseek_r1", ([1] * 8, None)),
    # Two spellings of the end, and a start of many tokens: the engine cannot follow it.
    ("granite", None)])
def test_tag_ids(name, ids):
    assert REASONING_PARSERS[name].tag_ids(_encode) == (None if ids is None else ids)


@pytest.mark.parametrize(("name", "pieces", "count"), [
    ("mistral", ["[THINK]", "a", "b", "[/THINK]", "c"], 4),
    ("mistral", ["a", "[/THINK]", "c"], 0),
    ("mistral", ["[THINK]", "a"], 2),
    ("granite", [*"Here's my thought process: a Here's my response:", "b"], 48),
    ("granite", ["Here is my thought process:", " a ", "Here is my ", "response:", " b"], 4),
    ("granite", ["Hi."], 0)])
def test_num_reasoning_tokens_counts_up_to_the_end_marker(name, pieces, count):
    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)
    assert REASONING_PARSERS[name].num_reasoning_tokens(list(range(len(pieces))), decode) == count


def test_no_tag_ids_for_an_end_of_several_spellings():
    parser = ThinkParser(implicit_start=True, ends=("</think>", "</thinking>"))
    assert parser.tag_ids(_encode) is None
    assert parser.split("a</thinking>b") == ("a", "b")
