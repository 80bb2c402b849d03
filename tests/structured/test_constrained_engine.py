"""Constrained decoding through ``EngineCore`` on a tiny random model with a byte-level tokenizer.

Unconstrained, the model writes noise; constrained, every output that finishes parses and validates
(jsonschema), and constraining changes nothing else: greedy (and seeded sampled) ids are the same
with and without prompt lookup, suffix decoding, a draft model or an EAGLE head, preemption by recompute,
prefix caching, chunked prefill and batch mates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_engines import byte_core, drafted_and_accepted, eagle_spec, train_tiny_head

from mechserve.api.config import SpeculativeConfig
from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.model.loader import LoadedModel

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ['{"name":"ab","age":3}', "hello hello hello", '[1,2,3] {"a":', "x"]


def run(
    loaded: LoadedModel,
    prompts: Sequence[str],
    params: SamplingParams | Sequence[SamplingParams],
    **config: Any,
) -> tuple[list[Any], list[Any]]:
    """Each prompt as one request (all at once), run until idle: the outputs (prompt order) and step records."""
    core = byte_core(loaded, **config)
    tok = loaded.tokenizer
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [core.add_request(tok.encode(p), sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, plist))]
    outs: dict[str, Any] = {}
    records = []
    while core.has_unfinished():
        step = core.step()
        records.append(step.record)
        outs.update({o.request_id: o for o in step.finished})
    core.check_pages()
    return [outs[i].outputs[0] for i in ids], records


def greedy(so: Any, max_tokens: int = 80, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_of_constraint_is_followed(byte_model: LoadedModel, temperature: float) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"json": json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 4})}, json.loads),
        ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or pytest.fail(t)),
        ({"choice": ["yes", "no", "maybe not"]}, lambda t: t in {"yes", "no", "maybe not"} or pytest.fail(t)),
        ({"grammar": 'root ::= "a" ("+" "a")* "."'}, lambda t: re.fullmatch(r"a(\+a)*\.", t) or pytest.fail(t)),
        ({"grammar": 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"\([0-9]{1,3}\)", t)),
    ]
    for so, check in cases:
        params = [
            SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs=so) for i in range(4)
        ]
        outs, _ = run(byte_model, PROMPTS, params)
        for out in outs:
            assert out.finish_reason == "stop", (so, out.text)
            assert check(out.text) is not False, (so, out.text)


def test_json_object_is_an_object_that_parses_or_a_prefix_of_one(byte_model: LoadedModel) -> None:
    """Any JSON object has no bound, so a random model may run to max_tokens; what finishes parses."""
    outs, _ = run(
        byte_model,
        PROMPTS,
        [SamplingParams(seed=i, max_tokens=150, structured_outputs={"json_object": True}) for i in range(4)],
    )
    assert all(o.text.startswith("{") for o in outs)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for o in finished:
        assert isinstance(json.loads(o.text), dict)


def test_unconstrained_output_is_noise(byte_model: LoadedModel) -> None:
    """The point of the model: without the grammar it does not write JSON."""
    (out,), _ = run(byte_model, ["hello"], SamplingParams(temperature=0.0, max_tokens=30))
    with pytest.raises(ValueError):
        json.loads(out.text)


# Bounded schemas (every string, array and number has a bound, objects name all their keys), so a
# finished output is short and the engine's output always finishes within max_tokens.
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
    st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
    st.sampled_from(
        [{"type": "string", "pattern": "^[a-c]{1,3}$"}, {"const": "k"}, {"type": "number", "minimum": 0, "maximum": 1}]
    ),
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.text("pqrs", min_size=1, max_size=2), children, min_size=1, max_size=3)
    return props.map(
        lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
    )


SCHEMAS = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        children.map(lambda c: {"type": "array", "items": c, "maxItems": 2}),
        st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs}),
    ),
    max_leaves=5,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.7, 1.5]))
def test_generated_schemas_always_validate(
    byte_model: LoadedModel, schema: dict[str, Any], seed: int, temperature: float
) -> None:
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=400, structured_outputs={"json": schema})
    (out,), _ = run(byte_model, ["{"], params)
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


# Exactness: constraining changes nothing else ------------------------------------------------------------------------

SCHEMA_CASES = [
    {"json": PERSON},
    {"regex": r"(ab|a|b){24,40}c"},
    {"grammar": 'root ::= ("{\\"" [a-c]+ "\\":" [0-9]+ "}")+'},
]


EXACT_PROMPTS = ['{"name":"ab","age":3}', "abababab", 'ab {"a":1}{"b":2}']
VARIANTS: dict[str, dict[str, Any]] = {
    "batch mates": {},
    "prompt lookup": {"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)},
    "suffix decoding": {"speculative": SpeculativeConfig(method="suffix", num_speculative_tokens=4, adaptive=False)},
    "chunked prefill": {"max_step_tokens": 5},
    "no prefix caching": {"prefix_caching": False, "output_caching": False},
    "preemption": {"num_pages": 15, "max_step_tokens": 3},
}


@pytest.mark.parametrize("so", SCHEMA_CASES, ids=["json", "regex", "gbnf"])
def test_greedy_ids_are_the_same_under_every_engine_mechanism(byte_model: LoadedModel, so: dict[str, Any]) -> None:
    params = greedy(so, max_tokens=32)
    alone = [run(byte_model, [p], params)[0][0].token_ids for p in EXACT_PROMPTS]
    for name, config in VARIANTS.items():
        outs, records = run(byte_model, EXACT_PROMPTS, params, **config)
        assert [o.token_ids for o in outs] == alone, name
        if name == "preemption":
            assert any(r.preempted for r in records)
        if name in ("prompt lookup", "suffix decoding"):
            assert sum(sum(r.drafted.values()) for r in records) > 0


def test_repeated_prompts_hit_the_prefix_cache_and_keep_their_ids(byte_model: LoadedModel) -> None:
    params = greedy({"json": PERSON}, max_tokens=32)
    core = byte_core(byte_model)
    tok = byte_model.tokenizer
    got = []
    reused = 0
    for i in range(3):  # one after another: the later ones reuse the first's published pages
        core.add_request(tok.encode('{"name":"ab","age":3} please'), params, request_id=f"r{i}")
        while core.has_unfinished():
            step = core.step()
            reused += bool(step.record.reused)
            got += [o.outputs[0].token_ids for o in step.finished]
    assert got[0] == got[1] == got[2] and reused


def test_draft_model_speculation_keeps_greedy_ids(byte_model: LoadedModel, byte_dir: Any) -> None:
    params = greedy({"json": PERSON}, max_tokens=32)
    alone = [run(byte_model, [p], params)[0][0].token_ids for p in EXACT_PROMPTS]
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model=str(byte_dir), adaptive=False)
    outs, records = run(byte_model, EXACT_PROMPTS, params, speculative=spec)
    assert [o.token_ids for o in outs] == alone
    assert sum(sum(r.drafted.values()) for r in records) > 0


# An EAGLE head: guesses from the model's hidden states, never the grammar's; verification keeps only what the mask
# and the target allow.  JSON keys and punctuation are forced runs (m14), which the head has no features for.
REGEX = r"(ab|a|b){24,40}c"
EAGLE_CASES = [
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
]
EAGLE_VARIANTS: dict[str, dict[str, Any]] = {
    "batch": {},
    # one request fits 20 pages (its prompt and 60 ids), the three together do not: preemption by recompute
    "preemption": {"num_pages": 20, "max_step_tokens": 64},
    "no-prefix-caching": {"prefix_caching": False, "output_caching": False},
}


@pytest.fixture(scope="module")
def byte_head(byte_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head for the byte model trained in seconds on its own greedy answers under each constraint, its guesses
    trained toward the ids the grammar chose (``chosen``): the random model's own argmax is almost never allowed,
    and verification must run over accepted guesses."""
    tok = byte_model.tokenizer
    sequences = []
    for so, _ in EAGLE_CASES:
        outs, _ = run(byte_model, EXACT_PROMPTS, greedy(so, max_tokens=60))
        sequences += [(tok.encode(p), o.token_ids) for p, o in zip(EXACT_PROMPTS, outs)]
    return train_tiny_head(byte_model.model, tmp_path_factory.mktemp("byte-head"), sequences, steps=80, chosen=True)


@pytest.mark.parametrize("case", range(len(EAGLE_CASES)), ids=["json", "regex"])
@pytest.mark.parametrize("variant", list(EAGLE_VARIANTS))
def test_an_eagle_head_keeps_constrained_greedy_ids_and_they_validate(
    byte_model: LoadedModel, byte_head: Path, case: int, variant: str
) -> None:
    so, check = EAGLE_CASES[case]
    params = greedy(so, max_tokens=60)
    alone = [run(byte_model, [p], params)[0][0].token_ids for p in EXACT_PROMPTS]
    outs, records = run(
        byte_model, EXACT_PROMPTS, params, speculative=eagle_spec(byte_head, 4), **EAGLE_VARIANTS[variant]
    )
    assert [o.token_ids for o in outs] == alone
    for out in outs:
        assert out.finish_reason == "stop", out.text
        check(out.text)
    drafted, accepted = drafted_and_accepted(records)
    assert 0 < accepted < drafted
    if variant == "preemption":
        assert any(r.preempted for r in records)


def test_an_eagle_head_keeps_seeded_constrained_ids(byte_model: LoadedModel, byte_head: Path) -> None:
    prompts = [*PROMPTS, "abababababab"]
    params = [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=50, structured_outputs={"regex": REGEX})
        for i in range(len(prompts))
    ]
    base, _ = run(byte_model, prompts, params)
    outs, records = run(byte_model, prompts, params, speculative=eagle_spec(byte_head, 4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert drafted_and_accepted(records)[0] > 0


@pytest.mark.parametrize(
    "config",
    [
        dict(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)),
        dict(speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=4, adaptive=False)),
        dict(num_pages=24, max_step_tokens=8),
    ],
    ids=["prompt lookup", "suffix decoding", "preemption"],
)
def test_seeded_sampled_ids_do_not_depend_on_speculation_or_preemption(
    byte_model: LoadedModel, config: dict[str, Any]
) -> None:
    prompts = [*PROMPTS, "abababababab"]
    params = [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=50, structured_outputs={"regex": r"(ab|a|b){2,30}c"})
        for i in range(len(prompts))
    ]
    base, _ = run(byte_model, prompts, params)
    outs, _ = run(byte_model, prompts, params, **config)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_a_constrained_request_with_unconstrained_batch_mates(byte_model: LoadedModel) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    mixed = [greedy({"json": PERSON}), plain, greedy({"choice": ["yes", "no"]}), plain]
    outs, _ = run(byte_model, PROMPTS, mixed)
    assert [o.token_ids for o in outs] == [run(byte_model, [p], sp)[0][0].token_ids for p, sp in zip(PROMPTS, mixed)]
    jsonschema.validate(json.loads(outs[0].text), PERSON)


# Refusals ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("so", "problem"),
    [
        ({"json": {"type": "object", "not": {}}}, "not"),
        ({"json": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
        ({"regex": "(a"}, "unclosed group"),
        ({"grammar": "start: nowhere"}, "nowhere"),
        ({"grammar": 'root ::= "a" | missing'}, "missing"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_problem(
    byte_model: LoadedModel, so: dict[str, Any], problem: str
) -> None:
    core = byte_core(byte_model)
    with pytest.raises(ParamError) as info:
        core.add_request([1, 2, 3], greedy(so))
    assert info.value.param == "structured_outputs" and problem in str(info.value)
    assert not core.has_unfinished()
    core.check_pages()


def test_compiled_grammars_are_cached_by_key(byte_model: LoadedModel) -> None:
    """A schema and its JSON text with its keys in another order are one grammar; another constraint is not."""
    core = byte_core(byte_model)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = core.compile_grammar(StructuredOutputsParams(json=schema))
    b = core.compile_grammar(
        StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    )
    c = core.compile_grammar(StructuredOutputsParams(regex="a+"))
    assert a is b and c is not a
    assert core.grammars._compiler is not None and core.grammars._compiler.compiled == 2


def test_the_word_tokenizer_cannot_be_constrained_and_says_so(tiny_word: LoadedModel) -> None:
    core = byte_core(tiny_word, num_pages=32)
    with pytest.raises(ParamError) as info:
        core.add_request([1, 2], greedy({"regex": "w1"}))
    assert info.value.param == "structured_outputs"


def test_forced_runs_append_the_masks_only_ids_and_change_no_id(byte_model: LoadedModel, monkeypatch) -> None:
    """m14 under a grammar: where the mask allows one id (JSON keys and punctuation of a fixed schema), the
    executor forces it instead of sampling; greedy and seeded ids are those of the run without forcing,
    and fewer forwards run (tokens are computed in the next step like a prefill chunk)."""
    from mechserve.executor import torch_executor

    params = [
        greedy({"json": PERSON}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured_outputs={"json": PERSON}),
    ]
    prompts = PROMPTS[:2]
    forced_outs, forced_records = run(byte_model, prompts, params)
    monkeypatch.setattr(torch_executor, "MAX_FORCED_RUN", 0)
    plain_outs, plain_records = run(byte_model, prompts, params)
    assert [o.token_ids for o in forced_outs] == [o.token_ids for o in plain_outs]
    for out in forced_outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    # '{"name":"' alone is 9 forced bytes: the forced run needs fewer steps
    assert len(forced_records) < len(plain_records) - 8, (len(forced_records), len(plain_records))
