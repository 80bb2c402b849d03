"""Constraints that compiled but failed inside the step (issue 31) are refused at compile time, saying why.

``GrammarCompiler.compile`` probes a grammar as the step will use it (the first mask, then seeded walks
that compute masks, forced tokens and consume) under llguidance's default limits, while the step's
matchers get twice those; a refusal is remembered; the build runs on a thread with a large stack.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import pytest
from tiny_models import BYTE_VOCAB

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_GRAMMAR_CHARS
from mechserve.api.params import StructuredOutputsParams as SO
from mechserve.executor.structured import (
    PROBE_LIMITS,
    STEP_LIMITS,
    GrammarCompiler,
    allowed_rows,
    new_bitmask,
    on_large_stack,
)
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


def test_a_constraint_of_exactly_the_size_limit_compiles_and_one_more_character_is_refused_by_name(
    compiler: GrammarCompiler,
) -> None:
    """``MAX_GRAMMAR_CHARS`` is the most a constraint may have (its key's text: a schema's sorted JSON)."""
    base = {"type": "string", "description": ""}
    pad = MAX_GRAMMAR_CHARS - len(SO(json=base).key[1])
    at_limit = SO(json={**base, "description": "x" * pad})
    assert len(at_limit.key[1]) == MAX_GRAMMAR_CHARS
    compiler.compile(at_limit)
    over = SO(json={**base, "description": "x" * (pad + 1)})
    with pytest.raises(ParamError) as info:
        compiler.compile(over)
    assert info.value.param == "structured_outputs"
    assert str(info.value) == (
        f"structured_outputs.json is {MAX_GRAMMAR_CHARS + 1} characters; at most {MAX_GRAMMAR_CHARS} are compiled"
    )


def test_a_grammar_llguidance_rejects_is_refused_as_not_compilable_with_its_words(compiler: GrammarCompiler) -> None:
    """What llguidance's validation says (with the tokenizer: a special token it lacks) after the field's name."""
    cases = [
        (
            SO(json={"not": {"type": "string"}}),
            'structured_outputs.json cannot be compiled: Unimplemented keys: ["not"]',
        ),
        (SO(grammar="start: foo"), 'structured_outputs.grammar cannot be compiled: at 1(8): unknown name: "foo"'),
        (
            SO(grammar='start: <|im_start|> "a"'),
            'structured_outputs.grammar cannot be compiled: at 1(8): unknown special token: "<|im_start|>"',
        ),
    ]
    for so, said in cases:
        with pytest.raises(ParamError) as info:
            compiler.compile(so)
        assert info.value.param == "structured_outputs" and str(info.value).startswith(said), str(info.value)


def test_a_tokenizer_llguidance_cannot_read_is_refused_saying_what_is_needed(tiny_word: LoadedModel) -> None:
    fresh = GrammarCompiler(tiny_word.tokenizer, tiny_word.model.arch.vocab_size)
    with pytest.raises(ParamError) as info:
        fresh.compile(SO(regex="w1"))
    assert info.value.param == "structured_outputs"
    assert str(info.value).startswith("structured outputs need a byte-level tokenizer with an EOS token: ")


@pytest.mark.parametrize("vocab_size", [BYTE_VOCAB, 288, 2048])
def test_any_logits_width_compiles_and_its_mask_is_the_grammars(byte_model: LoadedModel, vocab_size: int) -> None:
    """A model's logits may be wider than its tokenizer (padded to a multiple of 32 or 64: SmolLM2's 49152): the
    probe's mask and the step's are ``ceil(V / 32)`` words (llguidance refuses any other size)."""
    tok = byte_model.tokenizer
    fresh = GrammarCompiler(tok, vocab_size)
    m = fresh.compile(SO(regex="ab")).matcher([0])
    bitmask = new_bitmask(1, vocab_size)
    m.fill(bitmask, 0)
    assert allowed_rows(bitmask, vocab_size)[0].nonzero().flatten().tolist() == tok.encode("a")


def alternatives_rule(n: int) -> str:
    return "x: " + " | ".join(f'"w{i}"' for i in range(n))


@pytest.mark.parametrize(
    "grammar",
    [
        # the probe's walks take the first id on seeds 1-3 and the second on seed 0 ("b": complete and stopped)
        f'start: "a" x | "b"\n{alternatives_rule(2001)}',
        # the end is never one of the walks' choices while another id is allowed ("b", "c" only: seed 0 takes "c")
        f'start: ("b" | "c" x)?\n{alternatives_rule(2001)}',
    ],
    ids=["after-a-complete-walk", "behind-an-optional-end"],
)
def test_every_walk_of_the_probe_runs_so_a_problem_behind_another_branch_is_found(
    compiler: GrammarCompiler, grammar: str
) -> None:
    with pytest.raises(ParamError) as info:
        compiler.compile(SO(grammar=grammar))
    assert "cannot be served: it is too complex for the grammar engine (Parser Error: Current row has 2002" in str(
        info.value
    )


def test_the_refusal_memory_keeps_the_last_cache_size_keys(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused keys are remembered up to ``cache_size``, the oldest forgotten first (then built again)."""
    fresh = GrammarCompiler(byte_model.tokenizer, byte_model.model.arch.vocab_size, cache_size=2)
    empty = [SO(regex=f"[^\\x00-\\U0010FFFF]{c}") for c in "abc"]
    built: list[str] = []
    real_build = fresh._build

    def counting_build(so: SO) -> Any:
        built.append(so.key[1])
        return real_build(so)

    monkeypatch.setattr(fresh, "_build", counting_build)
    for so in (empty[0], empty[1], empty[0], empty[1]):
        with pytest.raises(ParamError, match=EMPTY):
            fresh.compile(so)
    assert built == [empty[0].key[1], empty[1].key[1]]  # both remembered
    for so in (empty[2], empty[1], empty[2], empty[0]):
        with pytest.raises(ParamError, match=EMPTY):
            fresh.compile(so)
    # c pushed a (the oldest) out; b and c were remembered; a was built again
    assert built == [empty[0].key[1], empty[1].key[1], empty[2].key[1], empty[0].key[1]]


def test_the_grammar_cache_keeps_the_last_cache_size_grammars(byte_model: LoadedModel) -> None:
    fresh = GrammarCompiler(byte_model.tokenizer, byte_model.model.arch.vocab_size, cache_size=2)
    a, b, c = (fresh.compile(SO(regex=r)) for r in ("a", "b", "c"))  # c pushes a out
    assert fresh.compiled == 3
    assert fresh.compile(SO(regex="b")) is b and fresh.compile(SO(regex="c")) is c and fresh.compiled == 3
    assert fresh.compile(SO(regex="a")) is not a and fresh.compiled == 4


def test_no_compile_prints_llguidances_log(compiler: GrammarCompiler, capfd: pytest.CaptureFixture[str]) -> None:
    """llguidance's log (its level 1 prints each parser error as a warning, level 2 the whole lexer) stays off on
    the probe's matcher and on the step's: a hostile request must not write to the server's stderr."""
    with pytest.raises(ParamError):
        compiler.compile(SO(grammar=alternatives(2001)))
    m = compiler.compile(SO(regex="ab")).matcher([0])
    m._m.consume_token(m.grammar.eos_token + 5)  # an id the grammar forbids: llguidance's matcher fails
    assert m._m.is_error()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


class RecordingLLMatcher:
    """llguidance's ``LLMatcher`` class, recording the arguments of each matcher built and each validation."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def __call__(self, tokenizer: Any, grammar: str, **kwargs: Any) -> Any:
        self.calls.append(("matcher", tokenizer, kwargs))
        return self.real(tokenizer, grammar, **kwargs)

    def validate_grammar_with_warnings(self, grammar: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("validate", args[0] if args else None, kwargs))
        return self.real.validate_grammar_with_warnings(grammar, *args, **kwargs)


def test_each_llguidance_call_of_a_compile_has_the_tokenizer_its_limits_and_no_log(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The validation and the probe run under ``PROBE_LIMITS`` (llguidance's defaults, fewer lexer states), the
    step's template under ``STEP_LIMITS`` (twice those: headroom), each with the tokenizer and llguidance's log off."""
    import llguidance

    recording = RecordingLLMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", recording)
    compiler.compile(SO(regex="ab"))
    lltok = compiler._tokenizer()

    def limits(kwargs: dict[str, Any]) -> dict[str, int] | None:
        given = kwargs.get("limits")
        return None if given is None else {name: getattr(given, name) for name in PROBE_LIMITS}

    assert [(kind, tok is lltok, limits(kw), kw.get("log_level", "unset")) for kind, tok, kw in recording.calls] == [
        ("validate", True, PROBE_LIMITS, "unset"),
        ("matcher", True, PROBE_LIMITS, 0),  # the probe
        ("matcher", True, STEP_LIMITS, 0),  # the step's template
    ]


def test_the_compile_thread_is_a_daemon_so_it_never_holds_the_process_at_exit() -> None:
    """The interpreter joins every non-daemon thread before it exits: a compile still running when the server
    is stopped (up to ``COMPILE_CPU_SECONDS`` between llguidance calls, or stuck inside one) must not hold the
    process.  Called from the main thread (as here), a thread that inherits its daemon flag would be one."""
    import threading

    assert threading.current_thread() is threading.main_thread()
    assert on_large_stack(lambda: threading.current_thread().daemon) is True


class ScriptedMatcher:
    """What ``probe_grammar`` uses of an llguidance matcher, over a script: the ids allowed after each consumed
    prefix (missing: none), the prefixes after which it is in an error state, and those after which it is stopped.
    Records every walk (the ids consumed between resets)."""

    def __init__(
        self,
        allowed: dict[tuple[int, ...], list[int]],
        errors: dict[tuple[int, ...], str] | None = None,
        stopped: frozenset[tuple[int, ...]] = frozenset(),
    ) -> None:
        self.allowed, self.errors, self.stopped = allowed, errors or {}, stopped
        self.path: tuple[int, ...] = ()
        self.walks: list[tuple[int, ...]] = []

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        bits = np.zeros(nbytes * 8, dtype=np.uint8)
        bits[self.allowed.get(self.path, [])] = 1
        packed = np.packbits(bits, bitorder="little")
        ctypes.memmove(ptr, packed.ctypes.data, nbytes)

    def is_error(self) -> bool:
        return self.path in self.errors

    def get_error(self) -> str:
        return self.errors[self.path]

    def stop_reason(self) -> str:
        return "InternalError"

    def compute_ff_tokens(self) -> list[int]:
        return []

    def consume_token(self, token: int) -> None:
        self.path += (token,)

    def is_stopped(self) -> bool:
        return self.path in self.stopped

    def reset(self) -> None:
        self.walks.append(self.path)
        self.path = ()


def test_a_first_mask_that_allows_nothing_is_an_empty_language_even_without_an_error() -> None:
    from mechserve.executor.structured import _EMPTY, probe_grammar

    assert probe_grammar(ScriptedMatcher({}), 0, 64, time.thread_time() + 60) == _EMPTY


@pytest.mark.parametrize("stops", [True, False], ids=["stopped", "only-the-end-allowed"])
def test_a_walk_that_completes_does_not_end_the_probe(stops: bool) -> None:
    """Walk 0 takes id 2 (seed 0 draws the second choice) and completes there (stopped, or only the end allowed);
    walk 1 takes id 1, after which the matcher fails: the probe reports it."""
    from mechserve.executor.structured import probe_grammar

    fake = ScriptedMatcher(
        {(): [1, 2], (2,): [0], (1,): [3]},
        errors={(1,): "Parser Error: too many items"},
        stopped=frozenset({(2,)}) if stops else frozenset(),
    )
    said = probe_grammar(fake, 0, 64, time.thread_time() + 60)
    assert said == "it is too complex for the grammar engine (Parser Error: too many items)"
    assert fake.walks == [(2,)]  # the failing walk returned before its reset


def test_the_probes_walks_are_seeded_so_a_verdict_is_the_same_every_time() -> None:
    from mechserve.executor.structured import PROBE_TOKENS, PROBE_WALKS, probe_grammar

    def walks() -> list[tuple[int, ...]]:
        # any of 20 ids at every position, for as long as a walk goes
        fake = ScriptedMatcher({})
        fake.allowed = AnyPrefix(list(range(1, 21)))  # type: ignore[assignment]
        assert probe_grammar(fake, 0, 64, time.thread_time() + 60) is None
        return fake.walks

    first = walks()
    assert len(first) == PROBE_WALKS and all(len(w) == PROBE_TOKENS for w in first)
    assert walks() == first and len(set(first)) == PROBE_WALKS  # the same walks, each its own


class AnyPrefix(dict):  # type: ignore[type-arg]
    """The same allowed ids after every prefix."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    def get(self, key: Any, default: Any = None) -> list[int]:
        return self.ids


def test_the_probe_stops_once_past_its_cpu_deadline_and_not_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from mechserve.executor import structured

    monkeypatch.setattr(structured.time, "thread_time", lambda: 5.0)
    grammar = {(): [1], (1,): [0]}
    assert structured.probe_grammar(ScriptedMatcher(grammar), 0, 64, 5.0) is None
    assert structured.probe_grammar(ScriptedMatcher(grammar), 0, 64, 4.999) == (
        f"checking it took more than {structured.COMPILE_CPU_SECONDS:g} s of CPU time"
    )
