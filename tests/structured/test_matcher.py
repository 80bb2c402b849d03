"""The per-request grammar matcher: window masks (row j after the first j guesses), a forbidden draft ends
the valid rows, rollback and rebuild give exactly a fresh matcher's state, forced tokens; and through the
executor, drafts the grammar forbids are never accepted while the ids stay the same."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tiny_engines import byte_core

from mechserve.api.config import EngineConfig
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.engine.core import EngineCore
from mechserve.executor.structured import GrammarCompiler, allowed_rows, is_allowed, new_bitmask
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model.loader import LoadedModel

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(byte_model: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(byte_model.tokenizer, byte_model.model.arch.vocab_size)


def mask_after(compiler: GrammarCompiler, so: StructuredOutputsParams, ids: list[int]) -> torch.Tensor:
    """The mask of a fresh matcher after ``ids`` (the reference every other state is checked against)."""
    m = compiler.compile(so).matcher([0])
    m.sync(ids)
    bm = new_bitmask(1, compiler.vocab_size)
    m.fill(bm, 0)
    return bm[0].clone()


def test_window_masks_are_the_states_after_the_guesses_before_each_row(byte_model: LoadedModel, compiler) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    tok = byte_model.tokenizer
    prefix = tok.encode('{"name":"a')
    guesses = tok.encode('bc","n":1') + tok.encode("x")  # valid up to the "x" (after an integer digit)
    m = compiler.compile(so).matcher([0])
    m.sync(prefix)
    before = mask_after(compiler, so, prefix)
    bm = new_bitmask(len(guesses) + 1, compiler.vocab_size)
    v = m.window_masks(guesses, bm, 0)
    assert v == len(guesses) - 1
    for j in range(v + 1):
        assert torch.equal(bm[j], mask_after(compiler, so, prefix + guesses[:j])), j
    assert not is_allowed(bm, v, guesses[v])  # the forbidden guess is masked at its row: the window ends there
    assert torch.equal(bm[v + 1], bm[v])  # past it: a copy, never reached
    # the matcher is where it was
    assert m.tokens == prefix
    after = new_bitmask(1, compiler.vocab_size)
    m.fill(after, 0)
    assert torch.equal(after[0], before)


def test_sync_rolls_back_a_rejected_guess_and_rebuilds_after_an_error(byte_model: LoadedModel, compiler) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    tok = byte_model.tokenizer
    a, b = tok.encode('{"name":"abc"'), tok.encode('{"name":"xy","n":4')
    m = compiler.compile(so).matcher([0])
    m.sync(a)
    m.sync(b)  # shares '{"name":"' with a: rolled back to it, then b's rest consumed
    assert m.tokens == b and m.rebuilds == 0
    bm = new_bitmask(1, compiler.vocab_size)
    m.fill(bm, 0)
    assert torch.equal(bm[0], mask_after(compiler, so, b))
    m._m.consume_token(tok.encode("q")[0])  # an invalid id: llguidance's matcher is now in its error state
    assert m._m.is_error()
    m.sync(a)  # rebuilt from a fresh copy (as after a preemption)
    assert m.rebuilds == 1 and m.tokens == a
    m.fill(bm, 0)
    assert torch.equal(bm[0], mask_after(compiler, so, a))
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        m.sync(tok.encode("nope"))


def test_eos_is_allowed_only_where_the_grammar_accepts_and_every_eos_id_is_the_end(byte_model, compiler) -> None:
    so = StructuredOutputsParams(choice=("ab", "abc"))
    tok = byte_model.tokenizer
    m = compiler.compile(so).matcher([0, 5])
    bm = new_bitmask(3, compiler.vocab_size)
    m.sync(tok.encode("a"))
    m.fill(bm, 0)
    m.sync(tok.encode("ab"))
    m.fill(bm, 1)
    assert not is_allowed(bm, 0, 0) and is_allowed(bm, 1, 0)
    m.sync([*tok.encode("ab"), 5])  # id 5 is one of the request's EOS ids: the grammar's end
    assert m.is_stopped()
    m.fill(bm, 2)
    assert allowed_rows(bm, compiler.vocab_size)[2].nonzero().flatten().tolist() == [0]


def test_forced_tokens_are_the_only_continuation(byte_model: LoadedModel, compiler) -> None:
    m = compiler.compile(StructuredOutputsParams(json=SCHEMA)).matcher([0])
    forced = m.forced_tokens()
    text = byte_model.tokenizer.decode(forced)
    assert forced and '{"name":"'.startswith(text)
    m.accept(forced)
    assert m.tokens == forced
    m2 = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).matcher([0])
    assert m2.forced_tokens() == []


def test_allowed_rows_unpacks_llguidance_bit_order() -> None:
    bm = new_bitmask(2, 70)
    bm.zero_()
    for t in (0, 31, 32, 69):
        from mechserve.executor.structured import set_bit

        set_bit(bm, 1, t)
    rows = allowed_rows(bm, 70)
    assert rows.shape == (2, 70) and rows.dtype == torch.bool
    assert not rows[0].any() and rows[1].nonzero().flatten().tolist() == [0, 31, 32, 69]


def test_drafts_the_grammar_forbids_are_never_accepted(byte_model: LoadedModel) -> None:
    """A proposer that always guesses letters for a digits-only regex: every window ends at its first guess,
    the ids are the unconstrained-by-speculation ones, and no guess is kept."""
    letters = byte_model.tokenizer.encode("zzzz")

    def propose(history: Any, num: int) -> list[int]:
        return letters[:num]

    so = {"regex": "[0-9]{10,20}"}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)
    prompt = byte_model.tokenizer.encode("count: 1 2 3")
    plain = byte_core(byte_model)
    plain.add_request(prompt, params)
    (want,) = plain.run_until_idle()
    config = EngineConfig(page_size=4, num_pages=64, spec_len=3)
    ex = TorchExecutor(byte_model.model, 64, 4, proposer=propose)
    core = EngineCore(byte_model, config, executor=ex)
    core.add_request(prompt, params)
    records = []
    while core.has_unfinished():
        step = core.step()
        records.append(step.record)
        got = step.finished or None
    assert got is not None and got[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert sum(sum(r.drafted.values()) for r in records) > 0
    assert sum(sum(r.accepted.values()) for r in records) == 0
    assert got[0].outputs[0].text.isdigit()


def test_an_end_after_a_complete_stopped_grammar_is_valid_as_a_guess_and_as_output(byte_model, compiler) -> None:
    """llguidance's validate_tokens refuses the end once a JSON value is closed (the matcher is stopped),
    though consuming it works: a guessed end there is valid, and an output ending with it syncs."""
    tok = byte_model.tokenizer
    m = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {}})).matcher([0])
    ids = tok.encode("{}")
    assert m.valid_prefix([*ids, 0]) == len(ids) + 1
    m.sync([*ids, 0])
    assert m.tokens == [*ids, 0] and m.is_stopped()
    m.sync(ids)  # rolled back past the end
    assert m.tokens == ids


def test_ends_past_a_stopped_grammar_are_counted_and_rolled_back(byte_model, compiler) -> None:
    """With ignore_eos a request keeps going after its end: the stopped grammar allows only more ends."""
    tok = byte_model.tokenizer
    m = compiler.compile(StructuredOutputsParams(regex="ab")).matcher([0])
    ids = tok.encode("ab")
    m.sync([*ids, 0, 0, 0])
    bm = new_bitmask(1, compiler.vocab_size)
    m.fill(bm, 0)
    assert allowed_rows(bm, compiler.vocab_size)[0].nonzero().flatten().tolist() == [0]
    assert m.valid_prefix([0, 0, 5]) == 2
    m.sync([*ids, 0])
    assert m.tokens == [*ids, 0]
    m.sync(ids[:1])
    m.fill(bm, 0)
    assert torch.equal(bm[0], mask_after(compiler, StructuredOutputsParams(regex="ab"), ids[:1]))


def test_a_bitmask_has_a_word_per_32_ids_all_allowed_and_each_bit_is_its_own_id() -> None:
    from mechserve.executor.structured import set_bit

    for vocab, words in ((33, 2), (64, 2), (65, 3)):
        bm = new_bitmask(2, vocab)
        assert bm.shape == (2, words) and bm.dtype == torch.int32 and bool((bm == -1).all())
        assert bool(allowed_rows(bm, vocab).all())
    bm = new_bitmask(1, 96)
    bm.zero_()
    chosen = {0, 1, 5, 31, 32, 33, 63, 64, 67, 95}
    for t in chosen:
        set_bit(bm, 0, t)
    assert [t for t in range(96) if is_allowed(bm, 0, t)] == sorted(chosen)
    assert allowed_rows(bm, 96)[0].nonzero().flatten().tolist() == sorted(chosen)


def test_an_engine_message_is_one_line_without_llguidances_markup_and_bounded() -> None:
    from mechserve.executor.structured import _line

    assert _line("a  b\n\t<non-verbose/>c") == "a b c"
    assert _line("x" * 300) == "x" * 300 and _line("x" * 301) == "x" * 297 + "..."
    assert _line("abcdefghij", limit=10) == "abcdefghij" and _line("abcdefghijk", limit=10) == "abcdefg..."


class FailedMatcher:
    """What ``_matcher_problem`` reads of an llguidance matcher in its error state."""

    def __init__(self, reason: str, error: str) -> None:
        self.reason, self.error = reason, error

    def stop_reason(self) -> str:
        return self.reason

    def get_error(self) -> str:
        return self.error


@pytest.mark.parametrize(
    ("reason", "error", "said"),
    [
        ("InternalError", "NoExtension: no token can follow", "empty"),
        ("InternalError", "NoExtensionBias", "empty"),
        ("ParserTooComplex", "budget spent", "it is too complex for the grammar engine (budget spent)"),
        ("InternalError", "Parser Error: deep", "it is too complex for the grammar engine (Parser Error: deep)"),
        ("LexerTooComplex", "x", "its regular expressions are too complex for the grammar engine (x)"),
        (
            "InternalError",
            "the Lexer  state\nlimit",
            "its regular expressions are too complex for the grammar engine (the Lexer state limit)",
        ),
        ("InternalError", "token 5 not allowed", "token 5 not allowed"),
    ],
)
def test_a_matchers_error_is_said_in_words_by_its_kind(reason: str, error: str, said: str) -> None:
    from mechserve.executor.structured import _EMPTY, _matcher_problem

    assert _matcher_problem(FailedMatcher(reason, error)) == (_EMPTY if said == "empty" else said)


@pytest.mark.parametrize("which", ["PROBE_LIMITS", "STEP_LIMITS"])
def test_llguidance_gets_each_limit_and_no_verbose_errors(which: str) -> None:
    """The limits the compile-time probe and the step's matchers run under (a hostile grammar's bound), and
    errors that never quote the grammar."""
    from mechserve.executor import structured

    values = getattr(structured, which)
    limits = structured._limits(values)
    assert {name: getattr(limits, name) for name in values} == values and limits.verbose_errors is False


def test_every_rebuild_is_counted(byte_model: LoadedModel, compiler) -> None:
    tok = byte_model.tokenizer
    m = compiler.compile(StructuredOutputsParams(json=SCHEMA)).matcher([0])
    for n in (1, 2, 3):
        m.rebuild(tok.encode('{"na'))
        assert m.rebuilds == n and m.tokens == tok.encode('{"na')


def test_the_ends_past_a_stopped_grammar_are_counted_one_by_one_and_rolled_back_without_a_rebuild(
    byte_model, compiler
) -> None:
    """An end given in one sync with the ids before it, ends added later one at a time, and a sync back past the
    ends into the grammar's own ids: each end past the stopped grammar counted once, nothing rebuilt, and no id
    but an end valid after one."""
    tok = byte_model.tokenizer
    so = StructuredOutputsParams(regex="ab")
    ids = tok.encode("ab")
    m = compiler.compile(so).matcher([0])
    m.sync([*ids, 0])  # the ids and the end at once: llguidance consumes this end itself
    assert (m.tokens, m._ends, m.rebuilds) == ([*ids, 0], 0, 0)
    m.sync([*ids, 0, 0])
    m.sync([*ids, 0, 0, 0])  # each end past the stopped grammar counted
    assert (m.tokens, m._ends, m.rebuilds) == ([*ids, 0, 0, 0], 2, 0)
    assert m.valid_prefix(ids[:1]) == 0 and m.valid_prefix([0, *ids[:1]]) == 1
    m.sync(ids[:1])  # back past three ends and one grammar id
    assert (m.tokens, m._ends, m.rebuilds) == (ids[:1], 0, 0)
    bm = new_bitmask(1, compiler.vocab_size)
    m.fill(bm, 0)
    assert torch.equal(bm[0], mask_after(compiler, so, ids[:1]))


def test_an_id_the_grammar_forbids_is_named_with_its_output_position(byte_model, compiler) -> None:
    tok = byte_model.tokenizer
    m = compiler.compile(StructuredOutputsParams(regex="abc")).matcher([0])
    a, b, x = (tok.encode(c)[0] for c in "abx")
    m.sync([a])
    with pytest.raises(ValueError) as caught:
        m.sync([a, b, x])
    assert str(caught.value) == f"output id {x} at output position 2 is not allowed by the grammar"


def test_the_only_id_the_mask_allows_is_found_in_any_bit_of_its_word(byte_model, compiler) -> None:
    """``only_token`` for one-character regexes whose id falls on each bit position of a mask word (bit 0
    included), and None while two ids are allowed or once only the end is."""
    tok = byte_model.tokenizer
    by_bit: dict[int, str] = {}
    for code in range(33, 127):
        ch = chr(code)
        ids = tok.encode(ch)
        if len(ids) == 1:
            by_bit.setdefault(ids[0] % 32, ch)
    assert 0 in by_bit, by_bit  # the case a mask word's lowest bit decides
    for ch in by_bit.values():
        m = compiler.compile(StructuredOutputsParams(regex=re.escape(ch))).matcher([0])
        assert m.only_token() == tok.encode(ch)[0], ch
        m.sync(tok.encode(ch))
        assert m.only_token() is None  # only the end may follow
    two = compiler.compile(StructuredOutputsParams(regex="a|b")).matcher([0])
    assert two.only_token() is None


def test_a_refused_constraint_is_refused_again_from_memory_naming_the_field(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mechserve.api.errors import ParamError

    fresh = GrammarCompiler(byte_model.tokenizer, byte_model.model.arch.vocab_size)
    so = StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]")  # an empty language (issue 31)
    with pytest.raises(ParamError) as first:
        fresh.compile(so)

    def no_build(_: Any) -> None:
        raise AssertionError("a refused key is not compiled again")

    monkeypatch.setattr(fresh, "_build", no_build)
    with pytest.raises(ParamError) as again:
        fresh.compile(so)
    assert (again.value.param, str(again.value)) == (first.value.param, str(first.value))
    assert first.value.param == "structured_outputs"


def test_an_id_that_is_one_of_the_requests_ends_is_never_the_only_token(byte_model, compiler) -> None:
    """Where the mask allows one id and that id is one of the request's end ids (a stop id the grammar allows),
    ``only_token`` gives None: an end is the sampler's to choose, never a forced id."""
    tok = byte_model.tokenizer
    (x,) = tok.encode("x")
    grammar = compiler.compile(StructuredOutputsParams(regex="x"))
    assert grammar.matcher([0]).only_token() == x
    assert grammar.matcher([0, x]).only_token() is None


class Unrolling:
    """An llguidance matcher that cannot roll back (or, with ``consume_fails``, cannot consume): the rest is real."""

    def __init__(self, real: Any, consume_fails: bool = False) -> None:
        self.real, self.consume_fails = real, consume_fails

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def rollback(self, n: int) -> bool:
        return False

    def consume_tokens(self, ids: list[int]) -> bool:
        return not self.consume_fails and bool(self.real.consume_tokens(ids))

    def get_error(self) -> str:
        return "the parser said no"


def test_a_sync_that_llguidance_cannot_roll_back_rebuilds_from_the_kept_ids(byte_model, compiler) -> None:
    from mechserve.executor.structured import GrammarMatcher

    so = StructuredOutputsParams(json=SCHEMA)
    tok = byte_model.tokenizer
    a, b = tok.encode('{"name":"abc"'), tok.encode('{"name":"xy"')
    grammar = compiler.compile(so)
    m = GrammarMatcher(grammar, Unrolling(grammar.fresh()), [0])
    m.sync(a)
    m.sync(b)  # needs a rollback of 4 ids, which fails: a fresh matcher consumes b
    assert m.rebuilds == 1 and m.tokens == b
    bm = new_bitmask(1, compiler.vocab_size)
    m.fill(bm, 0)
    assert torch.equal(bm[0], mask_after(compiler, so, b))


def test_a_consume_llguidance_fails_after_validating_is_an_error_with_its_words(byte_model, compiler) -> None:
    from mechserve.executor.structured import GrammarMatcher

    grammar = compiler.compile(StructuredOutputsParams(regex="ab"))
    m = GrammarMatcher(grammar, Unrolling(grammar.fresh(), consume_fails=True), [0])
    with pytest.raises(ValueError) as caught:
        m.sync(byte_model.tokenizer.encode("a"))
    assert str(caught.value) == "the grammar matcher failed: the parser said no"
