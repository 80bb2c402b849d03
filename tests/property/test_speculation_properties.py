"""Speculative decoding (m09+) and the token ids that travel back across the boundary (m10+).

The verdict of every decode window is predicted from the request's accept script and ``eos_after``
alone (MECHANISMS m09, resolve): one script entry per window, ``raw = drafted`` once the script is
absent or used up, ``accepted = clamp(raw, 0, drafted)`` then the EOS clamp.  The scripted model's ids
are a function of a request's own history, so preemption, speculation and the world size never
change them.  On m12 the door refuses a request whose largest frontier can never fit the pool
(NEVER_FITS, judged on ``max_new_tokens`` even when ``eos_after`` would end it sooner): such a request
has no ids at all, and every request the door accepted has exactly the ids it gets in a pool roomy
enough for everything.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI, MODULES, SLOW, execute, has_door, rung_index

from mechserve.conformance.strategies import alone_pages, engine_of, prompt_tokens, scripted_ids, workloads
from mechserve.spec import RUNGS

SPEC_RUNGS = [r for r in RUNGS if rung_index(r) >= 9]
BOUNDARY_RUNGS = [r for r in RUNGS if rung_index(r) >= 10]
DOOR_RUNGS = [r for r in RUNGS if has_door(r)]

SPECULATIVE = st.one_of(
    workloads(prompts="mixed", spec_len=(0, 4), scripts=True, max_new=8, negatives=True),
    workloads(prompts="shared", pool="tight", spec_len=(1, 3), scripts=True, max_new=8),
    workloads(budget="large", pool="ample", spec_len=(1, 4), scripts=True, max_new=8, world_size=(1, 4)),
    workloads(budget="large", pool="ample", spec_len=(1, 4), scripts=False, eos=False, max_new=8),
)

STOPPING = st.one_of(
    workloads(admission=True, prompts="mixed", spec_len=(0, 4), scripts=True, max_new=8, world_size=(1, 3)),
    workloads(admission=True, budget="large", pool="ample", spec_len=(1, 4), scripts=False, eos=False, max_new=8),
)
"""m12 only: stop ids (mostly ids the request will sample, so often inside an accepted run), limits,
zero-token requests and empty prompts."""


def check_verdicts(rung: str, workload: dict) -> None:
    """Every decode window's drafted/accepted/rolled_back follow from the script, the EOS clamp and (m12)
    the cut at the first stop id among the accepted guesses (N19)."""
    run = execute(rung, workload)
    k = engine_of(workload)["spec_len"]
    specs = {r["request_id"]: r for r in workload["requests"]}
    index = {r["request_id"]: i for i, r in enumerate(workload["requests"])}
    generated = dict.fromkeys(specs, 0)
    windows = dict.fromkeys(specs, 0)
    for rec in run.trace:
        for rid, d in rec["drafted"].items():
            spec, gen = specs[rid], generated[rid]
            assert gen >= 1, f"{rid}: a decode window before the first sample (D1)"
            assert d <= min(k, spec["max_new_tokens"] - gen - 1), (rid, d, gen)
            script = spec.get("accept_script") or []
            raw = script[windows[rid]] if windows[rid] < len(script) else d
            want = max(0, min(raw, d))
            if spec.get("eos_after") is not None:
                want = min(want, spec["eos_after"] - gen)
            guesses = scripted_ids(prompt_tokens(workload, index[rid]), gen + want)[gen:]
            stops = spec.get("stop_token_ids") or ()
            want = next((j for j, t in enumerate(guesses) if t in stops), want)
            assert rec["accepted"][rid] == want, (rid, rec, raw, gen)
            assert rec["rolled_back"][rid] == d - want
            if not script and spec.get("eos_after") is None and not stops:
                assert rec["rolled_back"][rid] == 0, "without a script every guess is accepted"
            windows[rid] += 1
        for rid in rec["executed"]:
            generated[rid] += rec["accepted"].get(rid, 0) + (rec["sampled"].get(rid) == "TOKEN")
    for r in run.engine.requests:
        assert r.generated == generated[r.request_id], "generated != TOKEN samples + accepted guesses"


@pytest.mark.parametrize("rung", SPEC_RUNGS)
@CI
@given(workload=SPECULATIVE)
def test_decode_window_verdicts_follow_the_script(rung: str, workload: dict) -> None:
    check_verdicts(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", SPEC_RUNGS)
@SLOW
@given(workload=SPECULATIVE)
def test_decode_window_verdicts_follow_the_script_slow(rung: str, workload: dict) -> None:
    check_verdicts(rung, workload)


@pytest.mark.parametrize("rung", DOOR_RUNGS)
@CI
@given(workload=STOPPING)
def test_decode_window_verdicts_cut_at_stop_ids(rung: str, workload: dict) -> None:
    check_verdicts(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", DOOR_RUNGS)
@SLOW
@given(workload=STOPPING)
def test_decode_window_verdicts_cut_at_stop_ids_slow(rung: str, workload: dict) -> None:
    check_verdicts(rung, workload)


def token_ids(run) -> dict[str, list[int]]:
    """Per request, the concatenation of its ``tokens`` over the trace."""
    ids: dict[str, list[int]] = {r.request_id: [] for r in run.engine.requests}
    for rec in run.trace:
        for rid, appended in rec["tokens"].items():
            ids[rid] += appended
    return ids


def ended(r) -> bool:
    """Whether ``r`` finished on an id it does not count in ``generated``: EOS, or a stop id (m12)."""
    return r.finish_reason is not None and r.finish_reason.value in ("EOS", "STOP")


def expected_ids(rung: str, workload: dict, run) -> dict[str, list[int]]:
    """The scripted model's ids from each request's own history, EOS id last when it ended with EOS
    and the next scripted id (the stop id) when it ended with STOP; none for a rejected request."""
    module = MODULES[rung]
    out = {}
    for i, r in enumerate(run.engine.requests):
        prompt = prompt_tokens(workload, i)
        prev, ids = (prompt[-1] if prompt else None), []
        for g in range(r.generated + (r.finish_reason is not None and r.finish_reason.value == "STOP")):
            prev = module.scripted_token(prev, len(prompt) + g)
            ids.append(prev)
        if r.finish_reason is not None and r.finish_reason.value == "EOS":
            ids.append(module.EOS_TOKEN_ID)
        out[r.request_id] = ids
    return out


def with_engine(workload: dict, **engine: int) -> dict:
    return {**workload, "engine": {**workload["engine"], **engine}}


def check_token_ids(rung: str, workload: dict) -> None:
    """Ids: length generated (+1 for EOS), a function of history; preemption and speculation change nothing.

    On m12 a rejected request has no ids and the comparison with the roomy pool is over the requests
    the door accepted (the roomy pool accepts them all).
    """
    run = execute(rung, workload)
    ids = token_ids(run)
    for r in run.engine.requests:
        assert len(ids[r.request_id]) == r.generated + ended(r)
        assert ids[r.request_id] == r.output_ids
        if r.state.value == "REJECTED":
            assert has_door(rung) and ids[r.request_id] == [] and r.reject_reason.value == "NEVER_FITS"
    assert ids == expected_ids(rung, workload, run)
    accepted = {r.request_id for r in run.engine.requests if r.state.value != "REJECTED"}
    eng = engine_of(workload)
    huge = sum(alone_pages(r, eng["page_size"]) for r in workload["requests"]) + 4
    roomy = execute(rung, with_engine(workload, num_pages=huge))
    assert all(rec["preempted"] == [] for rec in roomy.trace)
    assert all(r.state.value == "FINISHED" for r in roomy.engine.requests) or not has_door(rung)
    if run.error is None:
        assert {k: v for k, v in token_ids(roomy).items() if k in accepted} == {
            k: v for k, v in ids.items() if k in accepted
        }
        assert [s for s in roomy.engine.summary() if s["request_id"] in accepted] == [
            s for s in run.engine.summary() if s["request_id"] in accepted
        ]
    plain, spec = (execute(rung, with_engine(roomy.workload, spec_len=s)) for s in (0, 3))
    assert token_ids(plain) == token_ids(spec) == token_ids(roomy)
    assert plain.engine.summary() == spec.engine.summary() == roomy.engine.summary()


TOKENS = st.one_of(
    workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, max_new=7),
    workloads(prompts="mixed", pool="fits", spec_len=(0, 3), scripts=False, max_new=7, world_size=(1, 3)),
    workloads(prompts="mixed", spec_len=(0, 2), scripts=True, negatives=True),
)


@pytest.mark.parametrize("rung", BOUNDARY_RUNGS)
@CI
@given(workload=TOKENS)
def test_token_ids_are_a_function_of_history(rung: str, workload: dict) -> None:
    check_token_ids(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", BOUNDARY_RUNGS)
@SLOW
@given(workload=TOKENS)
def test_token_ids_are_a_function_of_history_slow(rung: str, workload: dict) -> None:
    check_token_ids(rung, workload)


def check_stop_ids(rung: str, workload: dict) -> None:
    """m12: a request ends at its first sampled stop id, which is its last id (N17); speculation, its
    scripts and the world size change no request's ids or end (N19: an accepted run is cut at a stop)."""
    run = execute(rung, workload)
    ids = token_ids(run)
    for r in run.engine.requests:
        assert len(ids[r.request_id]) == r.generated + ended(r) and ids[r.request_id] == r.output_ids
    assert ids == expected_ids(rung, workload, run)
    plain, spec, wide = (
        execute(rung, with_engine(workload, **engine))
        for engine in ({"spec_len": 0}, {"spec_len": 3}, {"world_size": 3})
    )
    for other in (plain, spec, wide):
        assert token_ids(other) == ids
        assert other.engine.summary() == run.engine.summary()


@pytest.mark.parametrize("rung", DOOR_RUNGS)
@CI
@given(workload=STOPPING)
def test_stop_ids_end_requests_whatever_the_speculation(rung: str, workload: dict) -> None:
    check_stop_ids(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", DOOR_RUNGS)
@SLOW
@given(workload=STOPPING)
def test_stop_ids_end_requests_whatever_the_speculation_slow(rung: str, workload: dict) -> None:
    check_stop_ids(rung, workload)
