"""Check 5, ladder consistency on the spec alone: a rung with its mechanism idle is the rung below."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mechserve.conformance import PAIRS, LadderMismatch, check_executor, check_ladder_pair
from mechserve.conformance.strategies import mechanism_idle

from . import mutants as m
from .conftest import CI

UPPER = [upper for upper, _ in PAIRS]


@pytest.mark.parametrize("upper", UPPER)
@CI
@given(data=st.data())
def test_each_rung_with_its_mechanism_idle_is_the_rung_below(upper: str, data: st.DataObject) -> None:
    check_ladder_pair(upper, data.draw(mechanism_idle(upper), label="workload"))


def test_a_rung_that_drafts_at_spec_len_zero_is_caught() -> None:
    workload = {
        "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8},
        "requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 4}],
    }
    with pytest.raises(
        LadderMismatch, match=r"ladder: m09 vs m08: first difference: step 1, field executed: m09={.a.: 2} m08={.a.: 1}"
    ):
        check_ladder_pair(
            "m09_speculative_decode", workload, modules={"m09_speculative_decode": m.m09_drafting_at_zero}
        )


def test_a_rung_that_records_admissions_backwards_is_caught() -> None:
    workload = {
        "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8},
        "requests": [
            {"request_id": "a", "prompt_len": 3, "max_new_tokens": 2},
            {"request_id": "b", "prompt_len": 2, "max_new_tokens": 2},
        ],
    }
    with pytest.raises(LadderMismatch, match=r"m12 vs m11: first difference: step 0, field admitted: m12=\['b', 'a'\]"):
        check_ladder_pair("m12_admission_control", workload, modules={"m12_admission_control": m.m12_admits_backwards})


def test_the_ladder_needs_no_target() -> None:
    report = check_executor(None, workloads=2, checks=["ladder"])
    (result,) = report.results
    assert report.passed and result.workloads == 2 * len(PAIRS) and report.target == "spec only"
