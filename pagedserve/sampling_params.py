"""Per-request sampling settings, named as in vLLM so users can switch by changing an import."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from pagedserve.field_types import plain_fields, wrong_type

_GREEDY_EPS = 1e-5
_MIN_REPETITION_PENALTY = 0.01
# Every stop string is searched for after every token, in the engine core's loop, which all
# requests share: 200,000 of them (a 4 MB body) slowed a concurrent request's tokens 7x.
# OpenAI takes 4; the clients that send more (evaluation harnesses) send a handful.
MAX_STOP_STRINGS = 64
# Bad words cost the same way: every step, the sampler compares the output's last tokens with
# each (as typed and with a leading space, so two token sequences a word), and the longest
# sets how far back it looks. 64 of up to 200 characters covers lists of words and phrases.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 200
# The engine core's wire (msgpack) and the sampler's tensors carry integers of 64 bits.
_INT64_FIELDS = ("n", "best_of", "top_k", "max_tokens", "min_tokens", "seed",
                 "truncate_prompt_tokens")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The sampler divides float32 logits by the temperature: a larger one is inf there, and a
# masked (-inf) logit divided by inf is NaN.
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names); exactly one field is set. ``json`` is a JSON
    schema (as a dict or its text), ``regex`` a regular expression, ``choice`` a list of
    exact strings, ``grammar`` an EBNF grammar (xgrammar's dialect, rule ``root`` first),
    ``json_object`` any JSON object. Checked against the grammar library when the request is
    admitted (``pagedserve.structured.spec``).

    For a model that reasons first, the grammar can wait for the reasoning to end (the API
    server sets these under ``--reasoning-parser``): with ``reasoning_end_token_ids`` (the
    tokenizer's ids of ``</think>``) the output is free until its tokens end with them. With
    ``reasoning_start_token_id`` as well (the id of ``<think>``, one token), the output reasons
    only if its first token is that one; otherwise the grammar applies from the start (as
    ``qwen3``'s parser reads an output; without it, as ``deepseek_r1``'s)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning_end_token_ids: list[int] | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise InvalidSamplingParam(
                "structured_outputs", "structured_outputs needs exactly one of json, regex, "
                f"choice, grammar, json_object; got {', '.join(given) or 'none'}")
        if self.choice is not None and not self.choice:
            raise InvalidSamplingParam("structured_outputs", "choice must not be empty")
        self._check_reasoning_ids()

    def _check_reasoning_ids(self) -> None:
        end, start = self.reasoning_end_token_ids, self.reasoning_start_token_id
        if end is not None:
            if not (isinstance(end, (list, tuple)) and end and all(_is_token_id(t) for t in end)):
                raise InvalidSamplingParam(
                    "structured_outputs", "structured_outputs reasoning_end_token_ids must be "
                    f"a non-empty list of token ids, got {end!r:.80}")
            self.reasoning_end_token_ids = [int(t) for t in end]
        if start is not None and (end is None or not _is_token_id(start)):
            raise InvalidSamplingParam(
                "structured_outputs", "structured_outputs reasoning_start_token_id must be a "
                f"token id, with reasoning_end_token_ids set; got {start!r:.80}")

    def _check_types(self) -> None:
        # A number as a regex failed in the grammar compiler with an AttributeError, and a
        # string as choice was read as a list of its characters.
        wrong = [
            name for name, ok in (
                ("json", self.json is None or isinstance(self.json, (str, dict))),
                ("regex", self.regex is None or isinstance(self.regex, str)),
                ("choice", self.choice is None or (isinstance(self.choice, (list, tuple))
                                                   and all(isinstance(c, str)
                                                           for c in self.choice))),
                ("grammar", self.grammar is None or isinstance(self.grammar, str)),
                ("json_object", isinstance(self.json_object, bool)))
            if not ok]
        if wrong:
            kinds = {"json": "a JSON schema (a dict or its text)", "choice": "a list of strings",
                     "json_object": "a boolean"}
            name = wrong[0]
            raise InvalidSamplingParam(
                "structured_outputs", f"structured_outputs {name} must be "
                f"{kinds.get(name, 'a string')}, got {getattr(self, name)!r:.80}")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Validation raises ``ValueError`` with the parameter's name so the server can turn it into a
    400 whose ``param`` field points at the culprit.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (checked against the vocabulary at admission).
    allowed_token_ids: list[int] | None = None
    # Words or phrases the output must not contain (vLLM's semantics): each bans its last
    # token wherever the output ends with the tokens before it; a one-token word is always
    # banned. Tokenized once, when the engine admits the request, into ``bad_words_token_ids``.
    bad_words: list[str] | None = None
    # The token sequences of ``bad_words``, each as typed and with a leading space; set by the
    # engine's input stage (``engine/input_processor``), which holds the tokenizer; a request
    # that sets it itself is refused there (each engine tokenizes with its own tokenizer).
    bad_words_token_ids: list[list[int]] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # 0: compute the prompt (and its logprobs), generate nothing
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Keep only the prompt's last k tokens (vLLM's); -1: as many as the context window leaves
    # room for, with one token to generate.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    # "cumulative": a RequestOutput every step the request advances, holding everything so far;
    # "delta": the same, holding only what is new (text, token ids, logprobs) since the last;
    # "final_only": one when it finishes, which spares offline runs the per-step copies.
    output_kind: str = "cumulative"
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # beam search: True, False or "never" (as in HF)
    # Constrained decoding: each token is drawn only from those the grammar allows.
    structured_outputs: StructuredOutputsParams | None = None
    # Arguments for the custom logits processors (``--logits-processors``), by name; each
    # processor reads its own and may refuse the request when it is admitted.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # The lists and dicts, each in the one form the engine reads; a value of another type
        # or with an element of another type is refused by name here, where it used to fail
        # with a TypeError naming nothing (now or in the detokenizer) or pass (a float id).
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        if self.logit_bias:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _bad_words(self.bad_words)
        if self.best_of is None:
            self.best_of = self.n
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        if self.extra_args is not None and not (
                isinstance(self.extra_args, dict)
                and all(isinstance(key, str) for key in self.extra_args)):
            raise InvalidSamplingParam("extra_args", "extra_args must be a dict with string "
                                                     f"keys, got {self.extra_args!r:.80}")
        self._validate()
        if self.is_greedy:
            # Greedy ignores the truncation knobs; normalising them lets the sampler skip them.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _validate(self) -> None:
        # Types first: the range checks below would fail on a string with a TypeError that
        # names no parameter, or pass a float count on to the sampler's integer tensors.
        wrong = wrong_type(self, _PLAIN_FIELDS)
        if wrong is not None:
            raise InvalidSamplingParam(wrong[0], f"{wrong[0]} {wrong[1]}")
        checks = [
            *[(_fits_int64(getattr(self, name)), name,
               f"{name} must be in [-2**63, 2**63), got {getattr(self, name)}")
              for name in _INT64_FIELDS],
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.best_of >= self.n, "best_of",
             f"best_of must be >= n ({self.n}), got {self.best_of}"),
            (0.0 <= self.temperature <= _FLOAT32_MAX, "temperature",
             f"temperature must be in [0, {_FLOAT32_MAX:.8g}] (float32's largest), "
             f"got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, "top_k",
             f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            # Bounded so that dividing or multiplying a logit by it stays finite in float32.
            (_MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1 / _MIN_REPETITION_PENALTY,
             "repetition_penalty", f"repetition_penalty must be in [{_MIN_REPETITION_PENALTY}, "
             f"{1 / _MIN_REPETITION_PENALTY:g}], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
             f"max_tokens must be non-negative, got {self.max_tokens}"),
            (not (self.use_beam_search and self.max_tokens == 0), "max_tokens",
             "beam search needs max_tokens of at least 1"),
            (self.min_tokens >= 0, "min_tokens",
             f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            # The upper bound is the engine's (--max-logprobs), checked by its input stage.
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be at least 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be at least 0, got {self.prompt_logprobs}"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
             f"truncate_prompt_tokens must be -1 or at least 1, got "
             f"{self.truncate_prompt_tokens}"),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            # They are searched for in the text, which detokenize=False does not make.
            (self.detokenize or not self.stop, "stop",
             "stop strings need detokenize=True (they are matched in the text); use "
             "stop_token_ids"),
            (self.output_kind in ("cumulative", "delta", "final_only"), "output_kind",
             f"output_kind must be cumulative, delta or final_only, got {self.output_kind!r}"),
            # The n best of best_of are known only at the end, after deltas of all of them.
            (not (self.output_kind == "delta" and self.best_of > self.n), "best_of",
             "best_of > n needs output_kind cumulative or final_only"),
            (math.isfinite(self.length_penalty), "length_penalty",
             f"length_penalty must be finite, got {self.length_penalty}"),
            (self.early_stopping in (True, False, "never"), "early_stopping",
             f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}"),
            (not (self.use_beam_search and self.stop), "stop",
             "beam search does not support stop strings; use stop_token_ids"),
            (not (self.use_beam_search and self.structured_outputs), "structured_outputs",
             "beam search does not support structured outputs"),
            # Beams keep no per-token logprobs (each has its cumulative_logprob), and scoring
            # the prompt of a beam request failed the engine step of every request with it.
            (not (self.use_beam_search and self.logprobs is not None), "logprobs",
             "beam search does not return per-token logprobs (each beam has its "
             "cumulative_logprob)"),
            (not (self.use_beam_search and self.prompt_logprobs is not None), "prompt_logprobs",
             "beam search does not support prompt_logprobs"),
            # The grammar decides where the output may end; min_tokens could forbid that end.
            (not (self.min_tokens and self.structured_outputs), "min_tokens",
             "min_tokens cannot be combined with structured outputs"),
            (all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidSamplingParam(param, message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampler computes the logprobs of this request's sampled tokens: asked
        for, or needed to rank best_of sequences or beams. Otherwise, as in vLLM, the outputs'
        ``cumulative_logprob`` is None, and a batch that needs none skips the passes over its
        logits (a third of the sampler's time at batch 1,000 with Llama-3's vocabulary)."""
        return self.logprobs is not None or self.best_of > self.n or self.use_beam_search

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request (best_of >= n)."""
        return self.best_of  # type: ignore[return-value]


_PLAIN_FIELDS = plain_fields(SamplingParams)


def _fits_int64(value: int | None) -> bool:
    return value is None or _INT64_MIN <= value <= _INT64_MAX


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParam("stop", f"at most {MAX_STOP_STRINGS} stop strings, got "
                                               f"{len(stop)}")
        return list(stop)
    raise InvalidSamplingParam("stop", f"stop must be a string or a list of strings, got "
                                       f"{stop!r:.80}")


def _token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids):
        return [int(t) for t in ids]
    raise InvalidSamplingParam("stop_token_ids", f"stop_token_ids must be a list of integers, "
                                                 f"got {ids!r:.80}")


def _allowed_token_ids(ids: Any) -> list[int]:
    if not (isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids)):
        raise InvalidSamplingParam("allowed_token_ids", "allowed_token_ids must be a list of "
                                                        f"integers, got {ids!r:.80}")
    if not ids:  # every logit -inf: the softmax is NaN and no token can be drawn
        raise InvalidSamplingParam("allowed_token_ids", "allowed_token_ids must not be empty")
    return [int(t) for t in ids]


def _bad_words(words: Any) -> list[str]:
    if not (isinstance(words, (list, tuple)) and all(isinstance(w, str) for w in words)):
        raise InvalidSamplingParam("bad_words", "bad_words must be a list of strings, got "
                                                f"{words!r:.80}")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidSamplingParam("bad_words", f"at most {MAX_BAD_WORDS} bad words, got "
                                                f"{len(words)}")
    for word in words:
        # Leading spaces are dropped before tokenizing (the spaced variant adds one back), so
        # a word of spaces alone would tokenize to nothing.
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidSamplingParam(
                "bad_words", f"each bad word must have 1 to {MAX_BAD_WORD_CHARS} characters, "
                f"not all spaces; got {word!r:.80}")
    return list(words)


def _logit_bias(bias: Any) -> dict[int, float]:
    """Token id -> bias; an id may be written as a string of digits (JSON's keys are)."""
    if not isinstance(bias, dict):
        raise InvalidSamplingParam("logit_bias", f"logit_bias must be a dict of token ids to "
                                                 f"numbers, got {bias!r:.80}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isascii() and token.isdigit() and len(token) < 100:
            token = int(token)  # (int() refuses past 4,300 digits)
        if not _is_int(token):
            raise InvalidSamplingParam("logit_bias", f"logit_bias key {token!r:.40} is not a "
                                                     "token id (an integer)")
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise InvalidSamplingParam("logit_bias", f"logit_bias value {value!r:.40} of token "
                                                     f"{token} is not a number")
        out[int(token)] = float(value)
    return out


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(map(str, set(value) - names))
        if not unknown:
            return StructuredOutputsParams(**value)
        raise InvalidSamplingParam("structured_outputs", f"structured_outputs has no field "
                                                         f"{unknown[0]}; its fields: "
                                                         f"{', '.join(sorted(names))}")
    raise InvalidSamplingParam("structured_outputs", "structured_outputs must be "
                                                     "StructuredOutputsParams or a dict of its "
                                                     f"fields, got {value!r:.80}")


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters, as vLLM names them; ``early_stopping`` is HF's rule
    (True, False or "never"), which vLLM's lacks. The beams score raw log-probabilities, as
    HF transformers' ``generate(num_beams=...)`` does, so temperature must stay 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise InvalidSamplingParam("beam_width", f"beam_width must be an integer of at "
                                                     f"least 1, got {self.beam_width!r}")
        if self.temperature != 0.0:
            raise InvalidSamplingParam("temperature", "beam search scores raw log-"
                                       f"probabilities: temperature must be 0, got "
                                       f"{self.temperature!r}")
        return SamplingParams(
            n=int(self.beam_width), best_of=int(self.beam_width), use_beam_search=True,
            temperature=0.0,
            max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output)


class InvalidSamplingParam(ValueError):
    """A sampling parameter outside its range; ``param`` names it for API error bodies."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
