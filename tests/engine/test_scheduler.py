"""``Scheduler``: m14 behind the runtime's contract (counts, page usage, finish with status, metrics facts)."""

from __future__ import annotations

from mechserve.api.config import EngineConfig
from mechserve.engine.scheduler import Scheduler
from mechserve.spec import m14_forced_runs as m14


def scheduler(num_pages: int, **config: object) -> Scheduler:
    """A scheduler over m14's scripted executor (no model): page size 1, a budget of 16 tokens."""
    cfg = EngineConfig(page_size=1, max_step_tokens=16, max_running=None, **config)  # type: ignore[arg-type]
    return Scheduler(
        cfg, num_pages=num_pages, max_model_len=None, eos_token_ids=(), executors=[m14.LocalExecutor({}, {})]
    )


def test_a_preemption_counts_only_when_computed_state_is_dropped() -> None:
    """A new user saw 185 preemptions for 12 requests: m05 N9 also "preempts" a scheduled request that holds
    no page yet, step after step while the pool is short. Only victims with computed state count."""
    s = scheduler(8)
    assert s.add("a", [1, 2, 3, 4], 5) is None
    assert s.add("b", [5, 6, 7, 8], 5) is None
    steps = [s.step() for _ in range(12)]
    pageless = [st for st in steps if st.record.preempted and st.preemptions == 0]
    assert pageless, "the workload never preempted a page-less request"
    for st in steps:
        assert st.preemptions <= len(st.record.preempted)
    s.check()


def test_counts_and_page_usage_follow_the_engine() -> None:
    s = scheduler(16)
    s.add("a", [1, 2, 3], 4)
    s.add("b", [4, 5], 2, arrival_step=2)
    assert s.counts() == (0, 2) and s.page_usage().free == 16
    first = s.step()
    assert s.counts() == (1, 1) and first.prompt_tokens == {"a": 3}
    usage = s.page_usage()
    assert usage.free + usage.cached + usage.private == 16 and usage.free < 16
    while s.has_live():
        s.step()
    s.check()
    assert s.page_usage().private == 0


def test_shared_pages_are_the_cached_pages_a_running_request_uses() -> None:
    """vLLM's KV usage counts cached blocks no request uses as free (they are evictable): ``in_use`` is a
    running request's own pages plus the cached pages in its page table."""
    s = scheduler(16)
    s.add("a", [1, 2, 3, 4, 5], 1)
    while s.has_live():
        s.step()
    idle = s.page_usage()
    assert idle.cached >= 4 and idle.shared == 0 and idle.in_use == 0  # a's prompt pages stay cached
    s.add("b", [1, 2, 3, 4, 9], 3)
    step = s.step()
    assert step.record.reused["b"] == 4
    busy = s.page_usage()  # b's 4 reused pages and its fifth prompt page, published by this step
    assert busy.shared == 5 and busy.in_use == busy.private + 5 and busy.cached == 6
    while s.has_live():
        s.step()
    assert s.page_usage().in_use == 0


def test_a_finish_outside_the_step_is_a_stop_not_an_abort() -> None:
    """A stop string ends a request between steps: the record of the step that found it says STOP and keeps
    only the ids before the cut; the next record does not list it as aborted; the summary says FINISHED."""
    s = scheduler(16, spec_len=3)
    s.add("a", [1, 2, 3], 10)
    record = s.step().record  # prefill, one token
    record = s.step().record  # a decode window: 3 guesses, all accepted by the scripted executor
    assert record.accepted["a"] == 3 and len(record.tokens["a"]) == 4
    s.finish("a", kept=2, generated=3)
    cut = s.cut(record)
    assert cut.finished["a"] is m14.FinishReason.STOP and cut.tokens["a"] == record.tokens["a"][:2]
    assert (cut.accepted["a"], cut.rolled_back["a"]) == (1, 2)
    after = s.step().record
    assert "a" not in after.aborted
    (entry,) = s.summary()
    assert (entry["state"], entry["finish_reason"], entry["generated"]) == ("FINISHED", "STOP", 3)
    s.check()


def test_every_cut_leaves_the_record_counting_what_the_request_keeps() -> None:
    """The record ``EngineCore`` hands on (and settles the executor with) counts, per decode window, only the
    guesses the request keeps: the scripted executor accepts all 3 guesses of each window, and each way of
    ending inside the run cuts ``accepted`` and ``tokens``: the spec's EOS trigger and a stop id (m12 N19),
    a stop string (``Scheduler.cut``), and max_tokens, which caps the window before it is drafted (m09)."""
    prompt = [1, 2, 3]
    chain, prev = [], prompt[-1]
    for j in range(8):
        prev = m14.scripted_token(prev, len(prompt) + j)
        chain.append(prev)

    def window(**add: object) -> m14.StepRecord:
        s = scheduler(16, spec_len=3)
        s.add("a", prompt, int(add.pop("max_new", 10)), **add)  # type: ignore[arg-type]
        s.step()  # the prefill samples chain[0]
        return s.step().record  # the decode window: guesses chain[1..3], the bonus chain[4]

    plain = window()
    assert (plain.drafted["a"], plain.accepted["a"], plain.tokens["a"]) == (3, 3, tuple(chain[1:5]))
    stop = window(stop_token_ids=(chain[2],))
    assert (stop.accepted["a"], stop.tokens["a"], stop.finished["a"]) == (1, tuple(chain[1:3]), m14.FinishReason.STOP)
    capped = window(max_new=3)
    assert (capped.drafted["a"], capped.accepted["a"], capped.tokens["a"]) == (1, 1, tuple(chain[1:3]))
    s = scheduler(16, spec_len=3)
    s.add("a", prompt, 10)
    s.step()
    record = s.step().record
    s.finish("a", kept=2, generated=3)  # a stop string ended in the second id the window appended
    cut = s.cut(record)
    assert (cut.accepted["a"], cut.rolled_back["a"], cut.tokens["a"]) == (1, 2, tuple(chain[1:3]))
    eng = m14.Engine([m14.Request("a", prompt, 10, eos_after=2)], 16, 1, 16, spec_len=3)
    eng.step()
    eos = eng.step()
    assert (eos.accepted["a"], eos.tokens["a"], eos.finished["a"]) == (
        1,
        (chain[1], m14.EOS_TOKEN_ID),
        m14.FinishReason.EOS,
    )
