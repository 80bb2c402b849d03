"""Closed objects by default (issue 29): a JSON schema object that lists properties and says nothing about others
allows no others, as vLLM's default grammar backend (xgrammar, strict_mode) reads it; the engine option
``allow_additional_properties`` gives JSON Schema's open objects back.  Checked on the schema rewrite itself and on
what the compiled grammar accepts, and end to end through the server (forced tool calls, response_format)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.api.config import EngineConfig
from mechserve.api.params import StructuredOutputsParams
from mechserve.executor.structured import GrammarCompiler, close_objects
from mechserve.model.loader import LoadedModel

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CLOSED = {**OPEN, "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "closed"),
    [
        (OPEN, CLOSED),
        ({"properties": {"a": {}}}, {"properties": {"a": {}}, "additionalProperties": False}),  # no type: still listed
        (
            {"type": "object", "patternProperties": {"^x": {}}},
            {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False},
        ),
        ({"type": "object", "properties": {}}, {"type": "object", "properties": {}, "additionalProperties": False}),
        ({**OPEN, "additionalProperties": True}, {**OPEN, "additionalProperties": True}),  # said: kept
        ({**OPEN, "additionalProperties": {"type": "string"}}, {**OPEN, "additionalProperties": {"type": "string"}}),
        ({**OPEN, "unevaluatedProperties": True}, {**OPEN, "unevaluatedProperties": True}),
        ({"type": "object"}, {"type": "object"}),  # a bare object stays any object (xgrammar's basic object)
        ({"type": "object", "description": "any"}, {"type": "object", "description": "any"}),
        (True, True),
        ({"type": "string"}, {"type": "string"}),
    ],
)
def test_which_objects_are_closed(schema: Any, closed: Any) -> None:
    assert close_objects(schema) == closed


def test_nested_schemas_are_closed_and_values_are_not_schemas() -> None:
    inner = {"type": "object", "properties": {"b": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": inner},
            "tuple": {"type": "array", "prefixItems": [inner]},
            "either": {"anyOf": [inner, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/Inner"},
            # a property named like keywords, and values that merely look like schemas: left alone
            "properties": {"const": {"properties": {"x": 1}}},
            "choice": {"enum": [{"properties": {}}]},
        },
        "$defs": {"Inner": inner},
        "default": {"properties": {"y": 2}},
    }
    out = close_objects(schema)
    closed = {**inner, "additionalProperties": False}
    p = out["properties"]
    assert out["additionalProperties"] is False and out["$defs"]["Inner"] == closed
    assert p["list"]["items"] == closed and p["tuple"]["prefixItems"] == [closed]
    assert p["either"]["anyOf"] == [closed, {"type": "null"}] and p["ref"] == {"$ref": "#/$defs/Inner"}
    assert p["properties"] == {"const": {"properties": {"x": 1}}} and p["choice"] == {"enum": [{"properties": {}}]}
    assert out["default"] == {"properties": {"y": 2}}
    assert "additionalProperties" not in schema, "the given schema is not changed"


def test_the_members_of_an_all_of_stay_open() -> None:
    """Closing each member would forbid the properties the others add (an empty intersection)."""
    a, b = {"properties": {"a": {}}}, {"properties": {"b": {}}}
    out = close_objects({"allOf": [a, b]})
    assert out == {"allOf": [a, b]}
    nested = close_objects({"allOf": [{"properties": {"a": {"properties": {"c": {}}}}}]})
    assert nested["allOf"][0]["properties"]["a"]["additionalProperties"] is False, "schemas inside a member close"


SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "object"}, True]),
    lambda inner: st.one_of(
        st.builds(
            lambda p: {"type": "object", "properties": p}, st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
        ),
        st.builds(lambda i: {"type": "array", "items": i}, inner),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(schema=SCHEMAS)
def test_closing_is_idempotent_and_only_adds_additional_properties(schema: Any) -> None:
    out = close_objects(schema)
    assert close_objects(out) == out

    def strip(s: Any) -> Any:  # the generated schemas name no property "additionalProperties"
        if isinstance(s, dict):
            return {k: strip(v) for k, v in s.items() if not (k == "additionalProperties" and v is False)}
        return [strip(v) for v in s] if isinstance(s, list) else s

    assert strip(out) == schema


@pytest.fixture(scope="module")
def compilers(byte_model: LoadedModel) -> dict[bool, GrammarCompiler]:
    vocab = byte_model.model.arch.vocab_size
    return {
        allow: GrammarCompiler(byte_model.tokenizer, vocab, allow_additional_properties=allow)
        for allow in (False, True)
    }


def accepts(compiler: GrammarCompiler, schema: Any, text: str, tokenizer: Any) -> bool:
    """Whether the grammar of ``schema`` takes all of ``text`` and may end there."""
    m = compiler.compile(StructuredOutputsParams(json=schema)).matcher([0])
    ids = tokenizer.encode(text)
    if m.valid_prefix(ids) < len(ids):
        return False
    m.sync(ids)
    return m.is_accepting()


@pytest.mark.parametrize("as_text", [False, True])
def test_the_compiled_grammar_refuses_extra_properties_unless_allowed(
    compilers: dict[bool, GrammarCompiler], byte_model: LoadedModel, as_text: bool
) -> None:
    tok = byte_model.tokenizer
    schema: Any = json.dumps(OPEN) if as_text else OPEN
    assert accepts(compilers[False], schema, '{"a":1}', tok)
    assert not accepts(compilers[False], schema, '{"a":1,"b":2}', tok)
    assert accepts(compilers[True], schema, '{"a":1}', tok)
    assert accepts(compilers[True], schema, '{"a":1,"b":2}', tok)
    assert accepts(compilers[False], {"type": "object"}, '{"z":[1]}', tok), "a bare object is any object"


def test_the_engine_option_reaches_the_compiler(byte_model: LoadedModel) -> None:
    from mechserve.engine.core import EngineCore

    assert EngineConfig().allow_additional_properties is False
    with pytest.raises(ValueError, match="allow_additional_properties"):
        EngineConfig(allow_additional_properties="yes")  # type: ignore[arg-type]
    for allow in (False, True):
        core = EngineCore(byte_model, EngineConfig(num_pages=16, page_size=4, allow_additional_properties=allow))
        core.compile_grammar(StructuredOutputsParams(json=OPEN))
        compiler = core.grammars._compiler
        assert compiler is not None and compiler.allow_additional_properties is allow


def test_a_list_of_item_schemas_is_closed_member_by_member() -> None:
    """``items`` as a list (draft 4's tuple form): each member is a schema and is closed."""
    props = {"properties": {"a": {"type": "integer"}}}
    got = close_objects({"type": "array", "items": [props, {"type": "string"}], "additionalItems": props})
    closed = {**props, "additionalProperties": False}
    assert got == {"type": "array", "items": [closed, {"type": "string"}], "additionalItems": closed}


def test_the_grammar_closes_objects_by_default_whether_the_schema_came_as_text_or_as_an_object() -> None:
    from mechserve.executor.structured import grammar_text

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = grammar_text(StructuredOutputsParams(json=close_objects(schema)), allow_additional_properties=True)
    open_ = grammar_text(StructuredOutputsParams(json=schema), allow_additional_properties=True)
    assert closed != open_
    assert grammar_text(StructuredOutputsParams(json=schema)) == closed
    assert grammar_text(StructuredOutputsParams(json=json.dumps(schema))) == closed


def test_a_json_object_constraint_is_the_any_object_schema_with_the_same_defaults() -> None:
    from mechserve.executor.structured import grammar_text

    assert grammar_text(StructuredOutputsParams(json_object=True)) == grammar_text(
        StructuredOutputsParams(json={"type": "object"})
    )


def test_a_compiler_built_without_the_option_closes_objects(byte_model: LoadedModel) -> None:
    """``GrammarCompiler``'s own default is vLLM's (closed objects), not only ``EngineConfig``'s."""
    tok = byte_model.tokenizer
    compiler = GrammarCompiler(tok, byte_model.model.arch.vocab_size)
    assert accepts(compiler, OPEN, '{"a":1}', tok)
    assert not accepts(compiler, OPEN, '{"a":1,"b":2}', tok)
