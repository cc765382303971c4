"""JSON Schema keywords that xgrammar 0.2.8 compiles as if they were absent, found before the
compile: the grammar would allow values the schema refuses, so such a schema is a 400 that
names the keyword and where it is, never an output that breaks it."""

from __future__ import annotations

from typing import Any

# Ignored wherever they appear (each checked against the converter's output).
_IGNORED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "propertyNames", "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef"})
# Ignored unless they allow everything anyway.
_IGNORED_UNLESS = {"uniqueItems": False, "unevaluatedProperties": True,
                   "unevaluatedItems": True, "additionalItems": True}
# Words that constrain nothing: they may sit beside a $ref or a combinator.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "discriminator"})
# A schema holding one of these compiles as that keyword alone: the others beside it go.
_EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unsupported_keyword(schema: Any) -> str | None:
    """Why ``schema`` cannot be enforced exactly (its first such keyword), or None."""
    stack = [(schema, "the schema")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _problem(node)
        if problem is not None:
            return f"{problem} (at {where}) is not supported: the grammar would ignore it"
        stack += [(s, f"{where}.{key}.{name}") for key in _SCHEMA_MAPS
                  if isinstance(node.get(key), dict) for name, s in node[key].items()]
        stack += [(node[key], f"{where}.{key}") for key in _SCHEMAS if key in node]
        stack += [(s, f"{where}.{key}[{i}]") for key in _SCHEMA_LISTS
                  if isinstance(node.get(key), list) for i, s in enumerate(node[key])]
    return None


def _problem(node: dict) -> str | None:
    for key in node:
        if key in _IGNORED or key in _IGNORED_UNLESS and node[key] != _IGNORED_UNLESS[key]:
            return f'"{key}"'
    if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
        return f'"$ref" to another document ({node["$ref"]!r:.80})'
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return '"allOf" of more than one schema'
    exclusive = next((key for key in _EXCLUSIVE if key in node), None)
    others = [key for key in node if key != exclusive and key not in _ANNOTATIONS]
    if exclusive is not None and others:
        return f'"{others[0]}" beside "{exclusive}"'
    return None
