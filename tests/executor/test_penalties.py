"""Penalties and token filters on one logits row (``process_logits``): vLLM's semantics, checked against a plain
Python reference of each rule, one rule at a time and all together (hypothesis)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.api.params import SamplingParams
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Row, Sampler, process_logits

V = 12
INF = float("-inf")


def reference(logits: Sequence[float], row: Row) -> list[float]:
    """vLLM v1's order (allowed ids, bad words, min_tokens, logit bias, repetition, frequency, presence), in Python."""
    p = row.params
    x = list(logits)
    output = list(row.history[row.prompt_len :])
    if p.allowed_token_ids is not None:
        x = [v if i in p.allowed_token_ids else INF for i, v in enumerate(x)]
    for word in row.request.bad_words_ids if row.request else ():
        if len(word) - 1 <= len(output) and (len(word) == 1 or output[-(len(word) - 1) :] == list(word[:-1])):
            x[word[-1]] = INF
    if row.token_index < p.min_tokens:
        for t in row.banned:
            x[t] = INF
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    for t in set(row.history):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in range(len(x)):
        count = output.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def assert_close(got: torch.Tensor, want: Sequence[float]) -> None:
    for g, w in zip(got.tolist(), want):
        assert (g == w == INF) or math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-5), (got.tolist(), want)


LOGITS = [2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.0, -0.5, 4.0, -3.0, 0.25, 1.5]
HISTORY = (3, 5, 8, 1, 8, 8, 2)  # prompt (3, 5, 8), then output (1, 8, 8, 2)


@pytest.mark.parametrize(
    ("fields", "changed"),
    [
        ({"repetition_penalty": 2.0}, {3: 1.5, 5: 0.0, 8: 2.0, 1: -2.0, 2: 0.25}),  # positive /2, negative *2
        ({"frequency_penalty": 0.5}, {1: -1.5, 8: 3.0, 2: 0.0}),  # once per occurrence in the output only
        ({"presence_penalty": 1.0}, {1: -2.0, 8: 3.0, 2: -0.5}),  # once, output only (3 and 5 are prompt ids)
        ({"logit_bias": {4: 100.0, 0: -1.0}}, {4: 97.5, 0: 1.0}),
        ({"allowed_token_ids": [0, 6]}, {i: INF for i in range(V) if i not in (0, 6)}),
    ],
)
def test_each_rule_on_one_row(fields: dict, changed: dict[int, float]) -> None:
    row = Row(SamplingParams(temperature=0.0, **fields), token_index=4, history=HISTORY, prompt_len=3)
    got = process_logits(torch.tensor([LOGITS]), [row])[0]
    want = [changed.get(i, v) for i, v in enumerate(LOGITS)]
    assert_close(got, want)
    assert_close(got, reference(LOGITS, row))


@pytest.mark.parametrize(
    ("fields", "changed"),
    [
        ({"repetition_penalty": 2.0}, {0: 1.0, 3: 1.5}),
        ({"frequency_penalty": 0.5}, {0: 1.0, 3: 2.5}),  # 0 twice in the output, 3 once
        ({"presence_penalty": 1.0}, {0: 1.0, 3: 2.0}),
    ],
)
def test_id_zero_is_penalised_like_any_other_id(fields: dict, changed: dict[int, float]) -> None:
    """Id 0 is a token like the others (SmolLM2's ``<|endoftext|>``, a byte tokenizer's first id): the penalties
    count it in the history and the output.  Mutation testing found the ranges ``0 <= t`` tightened to ``1 <= t``
    unseen: the property's histories rarely held a 0 in the examples it ran."""
    row = Row(SamplingParams(temperature=0.0, **fields), token_index=3, history=(0, 3, 0, 0), prompt_len=1)
    got = process_logits(torch.tensor([LOGITS]), [row])[0]
    assert_close(got, [changed.get(i, v) for i, v in enumerate(LOGITS)])
    assert_close(got, reference(LOGITS, row))


def test_a_rows_bad_word_ids_are_applied_with_every_other_setting_neutral() -> None:
    """The row is processed whenever its request carries bad word ids, whatever the params say (hypothesis
    found ``process_logits`` returning the row untouched: ``processed`` read ``params.bad_words`` only)."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    row = Row(params, 0, (), (0,), 1, request=ExecutorRequest("r", (), params, bad_words_ids=((0,),)))
    got = process_logits(torch.zeros(1, 12), [row])[0]
    assert got[0] == -math.inf and bool((got[1:] == 0).all())


def test_bad_words_ban_a_last_token_only_after_its_prefix() -> None:
    """vLLM's rule: a one-token word is always banned; a longer one bans its last token only when the output so
    far ends with its other tokens (the prompt does not count)."""
    params = SamplingParams(temperature=0.0, bad_words=("x",))  # the words' ids are given below
    words = ((7,), (8, 2, 4), (2, 6), (5, 9))

    def banned(history: tuple[int, ...], prompt_len: int) -> set[int]:
        got = process_logits(
            torch.tensor([LOGITS]),
            [Row(params, 4, (), history, prompt_len, request=ExecutorRequest("r", (), params, bad_words_ids=words))],
        )[0]
        return {i for i, v in enumerate(got.tolist()) if v == INF}

    assert banned((3, 5, 8, 1, 8, 2), 3) == {7, 4, 6}  # the output ends with 8, 2 (so also with 2)
    assert banned((3, 5, 8, 2, 8), 3) == {7}
    assert banned((5, 8, 2), 3) == {7}  # a prefix in the prompt does not count


def test_rows_without_processing_are_not_copied() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    plain = Row(SamplingParams(temperature=0.0), 0)
    assert process_logits(logits, [plain, plain]) is logits
    out = process_logits(logits, [plain, Row(SamplingParams(logit_bias={0: 5.0}), 0, (), HISTORY, 3)])
    assert out is not logits and out[0].tolist() == LOGITS and out[1, 0] == LOGITS[0] + 5
    assert logits.tolist() == [LOGITS, LOGITS]  # never modified in place


def test_greedy_choice_and_the_distribution_see_the_processed_logits() -> None:
    sampler = Sampler(seed=0)
    forced = Row(SamplingParams(temperature=0.0, logit_bias={9: 100.0}), 0, (), HISTORY, 3)
    assert sampler.choose(torch.tensor([LOGITS]), [forced]) == [9]
    sampled = Row(SamplingParams(temperature=1.0, allowed_token_ids=[2, 10], seed=3), 0, (), HISTORY, 3)
    probs = sampler.probs(torch.tensor([LOGITS]), [sampled])[0]
    assert set(probs.nonzero().flatten().tolist()) == {2, 10}
    assert all(
        sampler.choose(torch.tensor([LOGITS]), [sampled._replace(token_index=i)])[0] in (2, 10) for i in range(20)
    )


PARAMS = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 3.0]),
    frequency_penalty=st.sampled_from([0.0, -1.0, 0.7, 2.0]),
    presence_penalty=st.sampled_from([0.0, -2.0, 1.1]),
    logit_bias=st.one_of(
        st.none(), st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, allow_nan=False), max_size=3)
    ),
    allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, V - 1), min_size=1, max_size=4)),
    min_tokens=st.integers(0, 3),
    max_tokens=st.just(8),
)


@settings(max_examples=150, deadline=None)
@given(
    params=PARAMS,
    logits=st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=V, max_size=V),
    history=st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
    prompt_len=st.integers(1, 12),
    words=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=3).map(tuple), max_size=3),
    banned=st.lists(st.integers(0, V - 1), max_size=2).map(tuple),
    token_index=st.integers(0, 4),
)
def test_process_logits_equals_the_reference(
    params: SamplingParams,
    logits: list[float],
    history: list[int],
    prompt_len: int,
    words: list[tuple[int, ...]],
    banned: tuple[int, ...],
    token_index: int,
) -> None:
    row = Row(
        params,
        token_index,
        banned,
        tuple(history),
        min(prompt_len, len(history)),
        request=ExecutorRequest("r", (), params, bad_words_ids=tuple(words)),
    )
    got = process_logits(torch.tensor([logits]), [row])[0]
    assert_close(got, reference(logits, row))


def test_the_grammars_mask_comes_last_and_alone_when_the_filters_leave_it_nothing() -> None:
    """The grammar's mask (``Row.allowed``) is applied to the processed row; should min_tokens have banned
    every id the grammar allows, the mask alone applies to the raw logits (``_mask_row``)."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    allowed = torch.tensor([False, True, True, False, False])
    biased = SamplingParams(temperature=1.0, logit_bias={1: 10.0})
    assert process_logits(logits, [Row(biased, 0, allowed=allowed)])[0].tolist() == [INF, 12.0, 3.0, INF, INF]
    banned = SamplingParams(temperature=1.0, min_tokens=2, logit_bias={1: 10.0})
    out = process_logits(logits, [Row(banned, 0, banned=(1, 2), allowed=allowed)])
    assert out[0].tolist() == [INF, 2.0, 3.0, INF, INF]
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0]]


@pytest.mark.parametrize(
    ("fields", "row_fields", "changed"),
    [
        # each filter's ids past the row's last (V) are ignored, alone (an index past the row) or as the
        # only ids it has (an empty index must still be an integer one); the rest of the filter applies
        ({"allowed_token_ids": [0, V]}, {}, {i: INF for i in range(1, V)}),
        ({"allowed_token_ids": [V, V + 3]}, {}, {i: INF for i in range(V)}),
        ({"bad_words": ("x",)}, {"request": ((V,), (2,))}, {2: INF}),
        ({"min_tokens": 1}, {"banned": (4, V)}, {4: INF}),
        ({"min_tokens": 1}, {"banned": (V, V + 1)}, {}),
        ({"logit_bias": {2: 1.0, V: 5.0}}, {}, {2: 1.5}),
        ({"logit_bias": {V: 5.0}}, {}, {}),
        ({"repetition_penalty": 2.0}, {"history": (3, V), "prompt_len": 2}, {3: 1.5}),
        ({"repetition_penalty": 2.0}, {"history": (V, V + 2), "prompt_len": 1}, {}),
        ({"frequency_penalty": 0.5}, {"history": (3, 1, V), "prompt_len": 1}, {1: -1.5}),
        ({"presence_penalty": 1.0, "frequency_penalty": 1.0}, {"history": (3, V, V), "prompt_len": 1}, {}),
    ],
)
def test_ids_outside_the_row_are_ignored_by_every_filter(fields: dict, row_fields: dict, changed: dict) -> None:
    """``process_logits`` ignores ids past the logits row (the docstring's promise: the tokenizer's vocabulary
    may be smaller than the model's rows, and submission refuses ids outside it).  Mutation testing found
    each ``t < vocab`` check loosened to ``t <= vocab`` (an IndexError at id V) and the empty id lists built
    as float tensors (not an index) unseen."""
    params = SamplingParams(temperature=0.0, **fields)
    if "request" in row_fields:  # the bad words' ids, as the executor derives them from the tokenizer
        row_fields = {**row_fields, "request": ExecutorRequest("r", (), params, bad_words_ids=row_fields["request"])}
    row = Row(params, **{"token_index": 0, **row_fields})
    got = process_logits(torch.tensor([LOGITS]), [row])[0]
    assert_close(got, [changed.get(i, v) for i, v in enumerate(LOGITS)])


def test_min_tokens_bans_up_to_the_token_before_min_tokens_only() -> None:
    """At ``token_index == min_tokens`` the stop and EOS ids are allowed again (the row is processed for its
    bias, so only the bound decides)."""
    params = SamplingParams(temperature=0.0, min_tokens=2, logit_bias={0: 1.0})
    rows = [Row(params, i, (4, 9)) for i in (1, 2)]
    got = process_logits(torch.tensor([LOGITS, LOGITS]), rows)
    assert got[0, 4] == got[0, 9] == INF
    assert got[1, 4] == LOGITS[4] and got[1, 9] == LOGITS[9] and got[1, 0] == LOGITS[0] + 1


def test_a_row_error_says_what_was_raised() -> None:
    """The message a failed request's error carries (``RowError``): the cause's type and text."""
    from mechserve.executor.sampling import RowError

    row = Row(SamplingParams(), 0)
    err = RowError(row, ValueError("bad grammar state"))
    assert str(err) == "ValueError: bad grammar state" and err.row is row and isinstance(err.cause, ValueError)
