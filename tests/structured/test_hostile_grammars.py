"""Constraints that compiled but failed inside the step (issue 31) are refused at compile time, saying why.

``GrammarCompiler.compile`` probes a grammar as the step will use it (the first mask, then seeded walks
that compute masks, forced tokens and consume) under llguidance's default limits, while the step's
matchers get twice those; a refusal is remembered; the build runs on a thread with a large stack.
"""

from __future__ import annotations

import time

import pytest

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_GRAMMAR_CHARS
from mechserve.api.params import StructuredOutputsParams as SO
from mechserve.executor.structured import PROBE_LIMITS, STEP_LIMITS, GrammarCompiler, new_bitmask, on_large_stack
from mechserve.model.loader import LoadedModel

EMPTY = "it allows no output at all"


@pytest.fixture
def compiler(byte_model: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(byte_model.tokenizer, byte_model.model.arch.vocab_size)


def alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n))


@pytest.mark.parametrize(
    ("so", "why"),
    [
        (
            SO(grammar=alternatives(2001)),
            "too complex for the grammar engine (Parser Error: Current row has 2002 items",
        ),
        (SO(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), EMPTY),
        (SO(regex="[^\\x00-\\U0010FFFF]"), EMPTY),
    ],
    ids=["2001-way-alternative", "self-ref", "empty-regex"],
)
def test_the_issues_reproducers_are_refused_naming_why(compiler: GrammarCompiler, so: SO, why: str) -> None:
    with pytest.raises(ParamError) as info:
        compiler.compile(so)
    message = str(info.value)
    assert info.value.param == "structured_outputs"
    assert message.startswith(f"structured_outputs.{so.kind} cannot be served: ") and why in message, message
    assert '"w1999"' not in message and len(message) < 400  # never the grammar itself


def test_a_grammar_within_the_limits_compiles_and_its_step_has_headroom(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(SO(grammar=alternatives(1500)))
    matcher = grammar.matcher([0])
    bitmask = new_bitmask(1, compiler.vocab_size)
    matcher.fill(bitmask, 0)
    assert {k: 2 * v for k, v in PROBE_LIMITS.items()} == STEP_LIMITS


def test_a_refusal_is_remembered(compiler: GrammarCompiler) -> None:
    so = SO(grammar=alternatives(2001))
    with pytest.raises(ParamError) as first:
        compiler.compile(so)
    started = time.thread_time()
    with pytest.raises(ParamError) as again:
        compiler.compile(so)
    assert str(again.value) == str(first.value) and compiler.compiled == 0
    assert time.thread_time() - started < 0.05  # no build: a lookup (CPU time of this thread, not a wall bound)


def test_a_constraint_over_the_size_limit_is_refused_before_any_build(compiler: GrammarCompiler) -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_CHARS // 20)}}
    with pytest.raises(ParamError, match=f"at most {MAX_GRAMMAR_CHARS} are compiled"):
        compiler.compile(SO(json=big))


def test_a_chain_deeper_than_a_default_stack_compiles(compiler: GrammarCompiler) -> None:
    """3,000 chained rules crashed the process (a segfault) on an 8 MiB stack: the build runs on a larger one."""
    chain = "start: x0\n" + "\n".join(f"x{i}:x{i + 1}" for i in range(15_000)) + '\nx15000:"ok"'
    compiler.compile(SO(grammar=chain))


def test_on_large_stack_returns_or_raises_as_the_function_did() -> None:
    assert on_large_stack(lambda: 7) == 7
    with pytest.raises(KeyError):
        on_large_stack(lambda: {}["x"])
