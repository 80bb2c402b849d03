"""Incremental detokenization and stop strings (``mechserve.engine.detokenizer``), without a model.

The property at the end is field case BC19's whole kind: random token texts
(multi-character tokens and pieces of multi-byte characters), random stop
strings, token by token with streaming; the result must be the reference
"full text cut at the earliest stop occurrence", and no streamed character is
ever retracted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.engine.detokenizer import IncrementalDetokenizer, OutputText, StopStrings, find_stop, held_suffix


def byte_decoder(pieces: Sequence[bytes]):
    """A decode function over a byte vocabulary (id = index), UTF-8 with replacement, as byte-level BPE does."""

    def decode(ids: Sequence[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    return decode


def stream(pieces: Sequence[bytes], stops: Sequence[str] = (), include: bool = False, min_tokens: int = 0):
    """Push ids 0..n-1 of ``pieces`` one at a time; return (output, deltas, ids consumed)."""
    out = OutputText(byte_decoder(pieces), (), stops, include, min_tokens)
    deltas = []
    for i in range(len(pieces)):
        if out.push(i) is not None:
            break
        deltas.append(out.take())
    else:
        out.finish()
    deltas.append(out.take(final=True))
    return out, deltas, out.num_ids


def test_multi_byte_characters_are_never_split() -> None:
    text = "héllo € ✓ 日本"
    raw = text.encode()
    pieces = [raw[i : i + 1] for i in range(len(raw))]  # one byte per token: every character split
    detok = IncrementalDetokenizer(byte_decoder(pieces))
    deltas = [detok.push(i) for i in range(len(pieces))]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:3] == ["h", "", "é"]  # the first byte of é waits for the second


def test_a_token_ending_in_part_of_a_character_releases_what_comes_before() -> None:
    pieces = [b"C\xc3", b"\xa9!"]
    detok = IncrementalDetokenizer(byte_decoder(pieces))
    assert [detok.push(0), detok.push(1)] == ["C", "é!"]


def test_a_real_invalid_byte_is_kept() -> None:
    pieces = [b"a", b"\x80", b"b", b"\xe2\x82"]  # a lone continuation byte, then a truncated character at the end
    detok = IncrementalDetokenizer(byte_decoder(pieces))
    deltas = [detok.push(i) for i in range(len(pieces))]
    assert deltas == ["a", "", "\ufffdb", ""]  # held while it might still complete, released once it cannot
    assert detok.flush() == "\ufffd"


def test_prompt_context_is_not_emitted() -> None:
    pieces = [b"Hello", b" wor", b"ld", b"\xc3", b"\xa9"]
    detok = IncrementalDetokenizer(byte_decoder(pieces), prompt_ids=[0, 1])
    assert [detok.push(i) for i in (2, 3, 4)] == ["ld", "", "é"]


def test_find_stop_takes_the_occurrence_complete_first() -> None:
    assert find_stop("ABCD", ["BCD", "C"], 4).stop == "C"  # "C" is complete at character 3, "BCD" at 4
    assert find_stop("xABC", ["BC", "ABC"], 4).stop == "ABC"  # the same end: the one that starts first
    assert find_stop("ABCD", ["AB"], 1) is None  # "AB" ended before the one new character: looked for before


def test_held_suffix_is_the_longest_proper_prefix_of_a_stop() -> None:
    assert held_suffix("xxAB", ["ABC"]) == 2
    assert held_suffix("xxAB", ["AB"]) == 0  # a whole stop is not held: it would have matched
    assert held_suffix("xxA", ["AB", "xAz"]) == 2
    assert held_suffix("", ["AB"]) == 0


def test_streaming_holds_back_only_what_may_become_a_stop() -> None:
    s = StopStrings(["CD"])
    s.add("ABC")
    assert s.take() == "AB"  # "C" may start "CD"
    s.add("X")
    assert s.take() == "CX"
    s.add("C")
    assert s.take() == ""  # "C" may start "CD"
    assert s.add("D") is not None
    assert s.text == "ABCX" and s.take() == "" and s.take(final=True) == ""


@pytest.mark.parametrize(("stop", "text", "consumed"), [("DE", "ABC", 2), ("CD", "AB", 2), ("GHIA", "ABCDEF", 4)])
def test_stop_inside_or_across_tokens(stop: str, text: str, consumed: int) -> None:
    out, deltas, n = stream([b"ABC", b"DEF", b"GHI", b"ABC", b"DEF"], [stop])
    assert (out.text, out.stop, n) == (text, stop, consumed)
    assert "".join(deltas) == text


def test_include_stop_str_in_output_keeps_the_stop() -> None:
    out, deltas, n = stream([b"ABC", b"DEF", b"GHI"], ["DE"], include=True)
    assert (out.text, n, "".join(deltas)) == ("ABCDE", 2, "ABCDE")


def test_min_tokens_delays_the_search() -> None:
    out, _, n = stream([b"ABC", b"DEF", b"ABC", b"DEF"], ["AB"], min_tokens=2)
    assert (out.text, n) == ("ABCDEF", 3)  # the "AB" of token 1 is not looked for; token 3's is
    out, _, n = stream([b"ABC", b"DEF", b"GHI"], ["CD"], min_tokens=2)
    assert (out.text, n) == ("AB", 2)  # an occurrence that ends at token 2 is found through the lookback


def test_a_stop_in_the_held_back_bytes_is_found_at_the_end() -> None:
    out, deltas, _n = stream([b"a", b"\xe2\x82"], ["a\ufffd"])
    assert out.stop == "a\ufffd" and out.text == "" and "".join(deltas) == ""


# The property: the whole kind of BC19 ------------------------------------------------------------------------------

ALPHABET = "ABCé€"


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, int | None]:
    """``text`` cut at the stop occurrence complete first (ties: the one that starts first), by brute force;
    also that occurrence's end (None without one)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            longest = max(found, key=len)
            return text[: end if include else end - len(longest)], end
    return text, None


@st.composite
def tokenized(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A text over ALPHABET and its UTF-8 bytes cut at random points (characters split across tokens)."""
    text = draw(st.text(alphabet=ALPHABET, min_size=0, max_size=24))
    raw = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    bounds = [0, *(c for c in cuts if 0 < c < len(raw)), len(raw)]
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return text, pieces


@settings(max_examples=400, deadline=None)
@given(
    tokenized(),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=0, max_size=3),
    st.booleans(),
)
def test_bc_kind_stop_strings_match_the_reference_and_never_retract(
    sample: tuple[str, list[bytes]], stops: list[str], include: bool
) -> None:
    text, pieces = sample
    out, deltas, consumed = stream(pieces, stops, include)
    want, end = reference(text, stops, include)
    assert out.text == want
    assert "".join(deltas) == want  # streamed text is the result: nothing was retracted
    assert all("\ufffd" not in d for d in deltas)  # valid text: no half character ever shown
    if end is None:
        assert out.stop is None and consumed == len(pieces)
    else:
        # consumed: exactly the tokens up to the one that completes the stop's last character
        visible = [b"".join(pieces[:k]).decode("utf-8", errors="ignore") for k in range(len(pieces) + 1)]
        assert consumed == next(k for k in range(len(pieces) + 1) if len(visible[k]) >= end)
        assert out.stop is not None
        assert want.endswith(out.stop) if include else True


# Mutation testing (docs/mutation.md): each test below kills mutants the ones above let live ---------------------


def sentencepiece_decoder(pieces: Sequence[str]):
    """A decode function that drops the text's leading space, as SentencePiece does with its first piece: a
    token's text then depends on the ids before it, which is what the prompt's context ids are for."""

    def decode(ids: Sequence[int]) -> str:
        return "".join(pieces[i] for i in ids).removeprefix(" ")

    return decode


PIECES = [" The", " sky", " is", " blue", " today", " and", " warm"]


@pytest.mark.parametrize(
    ("prompt", "context", "first"),
    [
        ([0, 1], 5, " is"),  # with the prompt's last ids as context, the space after "sky" is emitted
        ([0, 1, 2, 3, 4, 5], 5, " is"),  # a prompt longer than the context: its last ids are the context
        ([0, 1], 1, " is"),  # one id of context is enough
        ([0, 1], 0, "is"),  # no context: the first output id decodes as the start of a text
        ([], 5, "is"),
    ],
)
def test_the_prompts_last_ids_are_the_first_windows_context(prompt: list[int], context: int, first: str) -> None:
    detok = IncrementalDetokenizer(sentencepiece_decoder(PIECES), prompt_ids=prompt, context=context)
    assert [detok.push(2), detok.push(3)] == [first, " blue"]
    out = OutputText(sentencepiece_decoder(PIECES), [0, 1])
    out.push(2)
    assert out.take(final=True) == " is"  # OutputText hands its prompt ids to its detokenizer


def test_output_text_leaves_the_stop_out_unless_asked() -> None:
    out = OutputText(byte_decoder([b"AB", b"CD"]), stops=["C"])  # include_stop left at its default
    assert [out.push(0), out.push(1)] == [None, "C"]
    assert out.text == "AB" and out.stop == "C"


def test_nothing_is_pushed_after_the_output_ended() -> None:
    out = OutputText(byte_decoder([b"AB", b"CD"]), stops=["B"])
    assert out.push(0) == "B"
    assert out.finish() is None  # finishing after a match is allowed and finds nothing more
    with pytest.raises(RuntimeError, match=r"^id pushed after the output ended$"):
        out.push(1, detokenize=False)  # even an id whose text is not added
    done = OutputText(byte_decoder([b"AB", b"CD"]))
    done.push(0)
    assert done.finish() is None
    with pytest.raises(RuntimeError, match=r"^id pushed after the output ended$"):
        done.push(1)
    s = StopStrings(["B"])
    s.add("AB")
    with pytest.raises(RuntimeError, match=r"^text added after a stop string matched$"):
        s.add("C")


@pytest.mark.parametrize(("min_tokens", "found"), [(1, True), (2, True), (3, False)])
def test_the_held_back_bytes_are_searched_once_min_tokens_are_out(min_tokens: int, found: bool) -> None:
    out = OutputText(byte_decoder([b"a", b"\xe2\x82"]), stops=["a\ufffd"], min_tokens=min_tokens)
    assert [out.push(0), out.push(1)] == [None, None]  # two ids: the truncated character is held back
    assert out.finish() == ("a\ufffd" if found else None)
    assert out.stop == ("a\ufffd" if found else None)
