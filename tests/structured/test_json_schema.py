"""JSON schemas as grammars: what xgrammar's converter gets wrong is fixed or refused here, so a
constrained output is always JSON that its schema accepts."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pagedserve.sampling_params import InvalidSamplingParam, StructuredOutputsParams
from pagedserve.structured.spec import MAX_SCHEMA_DEPTH, check, grammar_spec, to_grammar


@pytest.fixture(scope="module")
def compiler(default_model_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info)


def _accepts(compiler, schema: dict, text: str) -> bool:
    """Whether ``schema``'s grammar, compiled from the EBNF text the compile workers get,
    accepts the whole of ``text``."""
    ebnf = str(to_grammar(grammar_spec(StructuredOutputsParams(json=schema))))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 8},
    {"type": "string", "minLength": 1},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 8}},
     "required": ["a"]},
])
def test_bounded_strings_hold_no_raw_control_characters(compiler, schema):
    """xgrammar 0.2.8 writes a length-bounded string's characters as ``[^"\\\r\n]``, which
    lets a raw tab, NUL or escape character through: a random model wrote them, and the output
    was not JSON (json.loads: "Invalid control character")."""
    def value(s: str) -> str:
        return json.dumps({"a": s} if schema["type"] == "object" else s, ensure_ascii=False)

    assert _accepts(compiler, schema, value("ok \u00e9"))
    for bad in ["a\tb", "a\x00b", "a\x1bb", "a\x7f\x01"]:
        text = value("").replace('""', f'"{bad}"')  # the raw characters, unescaped
        with pytest.raises(ValueError):
            json.loads(text)
        assert not _accepts(compiler, schema, text), repr(text)


_INT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize(("schema", "words"), [
    ({"not": {}}, ['"not"', "at the schema"]),
    ({"type": "object", "properties": {"a": _INT}, "dependentRequired": {"a": ["b"]}},
     ['"dependentRequired"']),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, ['"if"']),
    ({"type": "object", "propertyNames": {"maxLength": 1}}, ['"propertyNames"']),
    ({"type": "array", "items": _INT, "uniqueItems": True}, ['"uniqueItems"']),
    ({"type": "array", "contains": {"const": 1}}, ['"contains"']),
    ({"type": "object", "properties": {"a": {"type": "object", "unevaluatedProperties": False}}},
     ['"unevaluatedProperties"', "at the schema.properties.a"]),
    ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, ['"allOf" of more than one schema']),
    ({"type": "object", "properties": {"a": _INT}, "allOf": [{"required": ["a"]}]},
     ['"type" beside "allOf"']),
    ({"anyOf": [{"type": "integer"}], "minimum": 3}, ['"minimum" beside "anyOf"']),
    ({"$ref": "http://example.com/s.json"}, ['"$ref" to another document']),
    ({"type": "array", "items": {"$dynamicRef": "#node"}}, ['"$dynamicRef"', "schema.items"]),
])
def test_keywords_the_grammar_would_ignore_are_refused(schema, words):
    """xgrammar 0.2.8 compiles these as if absent (``{"not": {}}`` wrote ``true``, an
    ``allOf`` of two schemas any JSON value at all): each is refused, naming it and where."""
    with pytest.raises(InvalidSamplingParam) as info:
        check(grammar_spec(StructuredOutputsParams(json=schema)), 1 << 16)
    assert info.value.param == "structured_outputs"
    message = str(info.value)
    assert all(w in message for w in words), message


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "integer"}], "description": "an annotation beside it"},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "T"},
    {"$defs": {"a": _INT}, "$ref": "#/$defs/a"},
    {"type": "array", "items": _INT, "uniqueItems": False},
    {"type": "object", "properties": {"not": _INT, "if": {"type": "string"}}},
    {"type": "object", "unevaluatedProperties": True, "enum": [{"contains": 1}]},
])
def test_schemas_the_grammar_enforces_pass(schema):
    check(grammar_spec(StructuredOutputsParams(json=schema)), 1 << 16)


@pytest.mark.parametrize("text", ["[" * 30_000 + "]" * 30_000,
                                  '{"items": ' * 5_000 + "{}" + "}" * 5_000])
def test_a_schema_nested_past_the_json_parser_is_refused(text):
    """A schema sent as a string is parsed here first: one nested deeper than Python's
    parser goes raised RecursionError, a 500 from the server."""
    with pytest.raises(InvalidSamplingParam) as info:
        check(grammar_spec(StructuredOutputsParams(json=text)), 1 << 16)
    assert info.value.param == "structured_outputs"
    assert "nested too deeply" in str(info.value)


def _nested(levels: int, key: str = "items") -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", key: schema} if key == "items" else \
            {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("key", ["items", "properties"])
def test_a_schema_nested_past_the_depth_limit_is_refused_before_xgrammar(key):
    """xgrammar's conversion time grows with about the cube of the nesting (300 levels of
    properties took seconds, 3,000 of items minutes) and the server parses every schema on
    its event loop; the depth is refused before xgrammar sees it."""
    with pytest.raises(InvalidSamplingParam) as info:
        check(grammar_spec(StructuredOutputsParams(json=_nested(300, key))), 1 << 16)
    assert "nested" in str(info.value) and str(MAX_SCHEMA_DEPTH) in str(info.value)


@pytest.mark.parametrize("key", ["items", "properties"])
def test_a_schema_at_the_depth_limit_passes(key):
    levels = MAX_SCHEMA_DEPTH - 1 if key == "items" else (MAX_SCHEMA_DEPTH - 1) // 2
    check(grammar_spec(StructuredOutputsParams(json=_nested(levels, key))), 1 << 16)
