"""Issue 27 item 4: each request's acceptance estimate is shrunk towards what the requests that left the
engine had kept (``governor.Acceptance``, empirical Bayes), not towards a fixed 0.5, so one lucky window on text
where guesses are rarely kept does not buy guess rows at batch 8, and on text where they are kept a new request
drafts at once.  The formulas are the class docstring's, written out here as the oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.executor.costs import StaticCosts
from mechserve.executor.governor import Acceptance, Candidate, Governor

events = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 4), st.integers(0, 4)).map(
            lambda t: (t[0], t[1], min(t[1], t[2]))
        ),
        st.tuples(st.sampled_from(["a", "b", "c", "unknown"])),  # a release
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(events, st.sampled_from([None, 0.9, 0.5]))
def test_rate_is_the_docstrings_shrinkage_towards_the_released_requests_acceptance(
    seen: list[tuple[str, int, int] | tuple[str]], pool_decay: float | None
) -> None:
    """The oracle: decayed per-request counts and lifetime counts; at a release (of a request with a record)
    its lifetime counts join the pool, which decays by ``pool_decay`` per release; ``rate`` = ``(accepted + 2 *
    prior) / (accepted + rejected + 2)`` with ``prior`` the pool's Laplace estimate."""
    a = Acceptance(decay=0.8, pool_decay=pool_decay)
    own: dict[str, list[float]] = {}  # decayed accepted, rejected; lifetime accepted, rejected
    pool = [0.0, 0.0]
    for event in seen:
        if len(event) == 1:
            a.release(event[0])
            gone = own.pop(event[0], None)
            if gone is not None and pool_decay is not None:
                pool = [pool[0] * pool_decay + gone[2], pool[1] * pool_decay + gone[3]]
            continue
        rid, proposed, accepted = event  # type: ignore[misc]
        a.observe(rid, proposed, accepted)
        rejected = 1.0 if accepted < proposed else 0.0
        c = own.setdefault(rid, [0.0, 0.0, 0.0, 0.0])
        c[0], c[1] = c[0] * 0.8 + accepted, c[1] * 0.8 + rejected
        c[2], c[3] = c[2] + accepted, c[3] + rejected
    prior = (pool[0] + 1.0) / (pool[0] + pool[1] + 2.0)
    assert a.prior == pytest.approx(prior)
    for rid in ("a", "b", "c", "never-seen"):
        expected = (own[rid][0] + 2.0 * prior) / (own[rid][0] + own[rid][1] + 2.0) if rid in own else prior
        assert a.rate(rid) == pytest.approx(expected)


def test_a_running_request_is_never_its_own_prior_and_an_engine_that_stops_drafting_drifts_back() -> None:
    """Only released requests feed the prior (at batch 1 the running request would otherwise count twice); a
    request that never proposed adds no verdict when it leaves, so after a bad spell the prior drifts back to
    0.5 as requests leave (the governor's only way to learn that the text changed)."""
    fixed, pooled = Acceptance(pool_decay=None), Acceptance()
    for a in (fixed, pooled):
        a.observe("r", 3, 3)
        assert a.prior == 0.5 and a.rate("r") == pytest.approx(4.0 / 5.0)  # (3 + 1) / (3 + 0 + 2)
        a.release("r")
    assert fixed.prior == 0.5 and pooled.prior == pytest.approx(4.0 / 5.0) and pooled.rate("new") == pooled.prior
    for i in range(20):
        pooled.observe(f"bad{i}", 4, 0)
        pooled.observe(f"bad{i}", 4, 0)
        pooled.release(f"bad{i}")
    assert pooled.prior < 0.15
    for i in range(100):
        pooled.observe(f"quiet{i}", 0, 0)
        pooled.release(f"quiet{i}")
    assert 0.49 < pooled.prior <= 0.5


@pytest.mark.parametrize("kwargs", [{"decay": 1.5}, {"decay": -0.1}, {"pool_decay": 2.0}, {"pool_decay": -1.0}])
def test_decays_outside_zero_to_one_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="decay"):
        Acceptance(**kwargs)
    Acceptance(decay=1.0, pool_decay=1.0)  # no decay at all is a setting


def test_one_lucky_window_buys_guess_rows_at_batch_8_only_when_the_engine_keeps_guesses() -> None:
    """Eight requests at batch 8, a guess row priced at 4% of their step (``row_cost=0.08``): request 0 just
    kept two guesses of a three-guess window.  After 200 requests whose guesses were kept a quarter of the time
    (open-ended text) it does not draft; with the fixed prior of 0.5 it did; after requests whose guesses were
    all kept (copying) it drafts."""
    governor = Governor(costs=StaticCosts(row_cost=0.08))

    def drafts(a: Acceptance) -> bool:
        a.observe("lucky", 3, 2)
        rates = [a.rate("lucky"), *[a.rate(f"quiet{i}") for i in range(7)]]
        candidates = [Candidate(4, 3, rates[0]), *[Candidate(4, 0, r) for r in rates[1:]]]
        k, limits = governor.decide(candidates, 4)
        return k > 0 and limits[0] != 0

    def engine(pattern: list[tuple[int, int]], pool_decay: float | None = 0.9) -> Acceptance:
        """An engine that served 200 requests of one window each, ``(proposed, accepted)`` in turn from ``pattern``."""
        a = Acceptance(pool_decay=pool_decay)
        for i in range(200):
            a.observe(f"past{i}", *pattern[i % len(pattern)])
            a.release(f"past{i}")
        return a

    quarter = [(1, 0), (1, 0), (1, 0), (1, 1)]  # one guess in four kept
    assert engine(quarter).prior == pytest.approx(0.33, abs=0.01)  # ~10 requests' worth, Laplace-smoothed
    assert not drafts(engine(quarter))
    assert drafts(engine(quarter, pool_decay=None))
    assert drafts(engine([(4, 4)]))
