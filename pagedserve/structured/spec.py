"""A request's structured-output ask as one hashable key, and its check against the grammar
library before the request enters the engine."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import NamedTuple

from pagedserve.sampling_params import InvalidSamplingParam, StructuredOutputsParams
from pagedserve.structured.schema_check import unsupported_keyword

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# OpenAI's json_object promises an object; xgrammar's builtin JSON grammar also allows a
# top-level array or scalar. Compiled as this schema instead, as vLLM does.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar 0.2.8 writes the characters of a length-bounded string (minLength, maxLength) as
# ``[^"\\\r\n]``, which lets raw control characters through, and JSON has none: a random
# model's output failed json.loads. Such a rule gets the class of xgrammar's other strings.
_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$',
                                 re.MULTILINE)
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'
# Objects and arrays within one another in a JSON schema's text. xgrammar's conversion time
# grows with about the cube of the depth (300 levels of properties: seconds; 3,000 of items:
# minutes), and the API server converts each schema (on a worker thread, but one that a
# request can occupy for minutes is a denial of service all the same); 128 levels convert in
# well under a tenth of a second, deeper than any schema written for a model's output.
MAX_SCHEMA_DEPTH = 128


class GrammarSpec(NamedTuple):
    """``kind`` is json | regex | grammar | json_object; ``text`` the schema as JSON text
    (keys in the caller's order: properties are generated in that order; json_object's is
    ``JSON_OBJECT_SCHEMA``), pattern or EBNF."""

    kind: str
    text: str


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return GrammarSpec("json", schema)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        # Each choice as a JSON string literal, which the EBNF dialect reads the same way.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return GrammarSpec("grammar", f"root ::= {alternatives}")
    if params.grammar is not None:
        return GrammarSpec("grammar", params.grammar)
    return GrammarSpec("json_object", JSON_OBJECT_SCHEMA)


def to_grammar(spec: GrammarSpec):
    """The xgrammar ``Grammar`` of ``spec``; raises ``InvalidSamplingParam`` with the
    library's own message for a bad schema, regex or grammar."""
    import xgrammar as xgr

    if spec.kind == "json":
        _check_keywords(spec.text)
    try:
        if spec.kind in ("json", "json_object"):
            # No free whitespace between tokens: a small model would otherwise pad forever.
            grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
            return _without_raw_control_characters(grammar)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _LOCATION.sub("", str(exc).strip())
        raise InvalidSamplingParam(
            "structured_outputs", f"invalid {spec.kind} for structured output: {message}"
        ) from None


def _check_keywords(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError:
        return  # xgrammar names the error
    except RecursionError:  # valid JSON, but deeper than Python's parser goes
        raise InvalidSamplingParam("structured_outputs", "invalid json for structured "
                                   "output: the schema is nested too deeply") from None
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidSamplingParam(
            "structured_outputs", "invalid json for structured output: the schema is nested "
            f"more than {MAX_SCHEMA_DEPTH} objects and arrays deep")
    problem = unsupported_keyword(schema)
    if problem is not None:
        raise InvalidSamplingParam("structured_outputs",
                                   f"invalid json for structured output: {problem}")


def _depth(value: object) -> int:
    """How many objects and arrays deep ``value`` goes (without recursion)."""
    deepest, level = 0, [value]
    while level := [node for node in level if isinstance(node, dict | list)]:
        deepest += 1
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)]
    return deepest


def _without_raw_control_characters(grammar):
    import xgrammar as xgr

    text, count = _BOUNDED_CHARACTERS.subn(
        lambda m: m[1] + _JSON_STRING_CHARACTER + m[2], str(grammar))
    return xgr.Grammar.from_ebnf(text) if count else grammar


def check(spec: GrammarSpec, max_bytes: int) -> None:
    """Refuse a text over ``max_bytes`` (``--max-grammar-bytes``), then parse ``spec``."""
    size = len(spec.text.encode())
    if size > max_bytes:
        raise InvalidSamplingParam(
            "structured_outputs", f"the {spec.kind} for structured output has {size} bytes, "
            f"more than the {max_bytes} this server accepts (--max-grammar-bytes)")
    _parse(spec)


@lru_cache(maxsize=256)
def _parse(spec: GrammarSpec) -> None:
    """Parse ``spec`` once (a cached success costs nothing the next time)."""
    to_grammar(spec)
