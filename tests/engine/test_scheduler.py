"""``Scheduler``: m14 behind the runtime's contract (counts, page usage, schedule/commit with a stop, metrics facts)."""

from __future__ import annotations

from typing import Any

from mechserve.api.config import EngineConfig
from mechserve.engine.scheduler import Scheduler, Step, StopHook
from mechserve.spec import m16_request_draft_lengths as m16


class Scripted(Scheduler):
    """A scheduler over m14's scripted executor (no model), stepped as ``EngineCore.step`` steps it."""

    def step(self, stop: StopHook | None = None) -> Step:
        return self.commit(self.ranks.execute(self.schedule()), stop)


def scheduler(num_pages: int, **config: Any) -> Scripted:
    """A scheduler over m14's scripted executor: page size 1, a budget of 16 tokens."""
    cfg = EngineConfig(page_size=1, max_step_tokens=16, max_running=None, **config)
    ranks = [m16.LocalExecutor({}, {})]
    s = Scripted(cfg, num_pages=num_pages, max_model_len=None, eos_token_ids=(), executors=ranks)
    s.ranks = m16.ExecutorGroup(ranks)  # type: ignore[attr-defined]
    return s


def stop_after(rid: str, keep: int, at_step: int, s: Scheduler) -> StopHook:
    """A stop that keeps ``keep`` of the ids ``rid`` appends in step ``at_step`` (a stop string found there)."""

    def stop(request_id: str, ids: tuple[int, ...], reason: m16.FinishReason | None) -> int | None:
        return keep if request_id == rid and s.step_counter == at_step else None

    return stop


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


def test_a_stop_decided_on_text_is_a_stop_inside_the_commit() -> None:
    """A stop string ends a request inside the commit of the step that found it (m12 N26): the record says
    STOP and keeps only the ids before the cut, its window's accepted counts only the guesses kept, the
    request's pages return, the next record lists no abort and the summary says FINISHED, STOP."""
    s = scheduler(16, spec_len=3)
    s.add("a", [1, 2, 3], 10)
    s.step()  # prefill, one token
    seen: list[tuple[str, tuple[int, ...], m16.FinishReason | None]] = []

    def stop(rid: str, ids: tuple[int, ...], reason: m16.FinishReason | None) -> int | None:
        seen.append((rid, ids, reason))
        return 2

    record = s.step(stop).record  # a decode window: 3 guesses, all accepted by the scripted executor
    ((rid, ids, reason),) = seen
    assert (rid, len(ids), reason) == ("a", 4, None)  # asked once, with the 4 ids it appended, still running
    assert record.finished["a"] is m16.FinishReason.STOP and record.tokens["a"] == ids[:2]
    assert (record.accepted["a"], record.rolled_back["a"]) == (1, 2)
    assert s.counts() == (0, 0) and s.page_usage().private == 0
    (entry,) = s.summary()
    assert (entry["state"], entry["finish_reason"], entry["generated"]) == ("FINISHED", "STOP", 3)
    after = s.step().record
    assert "a" not in after.aborted
    s.check()


def test_the_stop_is_told_the_finish_reason_of_a_request_that_ended_in_the_step() -> None:
    """A request m14 ended in the step (here at max_new_tokens) is asked with its finish reason, so the text
    can release what it held back and still end it with STOP keeping every id."""
    s = scheduler(16)
    s.add("a", [1, 2, 3], 1)
    seen = []

    def stop(rid: str, ids: tuple[int, ...], reason: m16.FinishReason | None) -> int | None:
        seen.append(reason)
        return len(ids)

    record = s.step(stop).record
    assert seen == [m16.FinishReason.LENGTH] and record.finished["a"] is m16.FinishReason.STOP
    assert len(record.tokens["a"]) == 1


def test_every_cut_leaves_the_record_counting_what_the_request_keeps() -> None:
    """The record ``EngineCore`` hands on (and settles the executor with) counts, per decode window, only the
    guesses the request keeps: the scripted executor accepts all 3 guesses of each window, and each way of
    ending inside the run cuts ``accepted`` and ``tokens``: the spec's EOS trigger and a stop id (m12 N19),
    a stop string (the commit's stop, m12 N26), and max_tokens, which caps the window before it is drafted
    (m09)."""
    prompt = [1, 2, 3]
    chain, prev = [], prompt[-1]
    for j in range(8):
        prev = m16.scripted_token(prev, len(prompt) + j)
        chain.append(prev)

    def window(**add: object) -> m16.StepRecord:
        s = scheduler(16, spec_len=3)
        s.add("a", prompt, int(add.pop("max_new", 10)), **add)  # type: ignore[arg-type]
        s.step()  # the prefill samples chain[0]
        return s.step().record  # the decode window: guesses chain[1..3], the bonus chain[4]

    plain = window()
    assert (plain.drafted["a"], plain.accepted["a"], plain.tokens["a"]) == (3, 3, tuple(chain[1:5]))
    stop = window(stop_token_ids=(chain[2],))
    assert (stop.accepted["a"], stop.tokens["a"], stop.finished["a"]) == (1, tuple(chain[1:3]), m16.FinishReason.STOP)
    capped = window(max_new=3)
    assert (capped.drafted["a"], capped.accepted["a"], capped.tokens["a"]) == (1, 1, tuple(chain[1:3]))
    s = scheduler(16, spec_len=3)
    s.add("a", prompt, 10)
    s.step()
    cut = s.step(stop_after("a", 2, 1, s)).record  # a stop string ended in the second id the window appended
    assert (cut.accepted["a"], cut.rolled_back["a"], cut.tokens["a"]) == (1, 2, tuple(chain[1:3]))
    eng = m16.Engine([m16.Request("a", prompt, 10, eos_after=2)], 16, 1, 16, spec_len=3)
    eng.step()
    eos = eng.step()
    assert (eos.accepted["a"], eos.tokens["a"], eos.finished["a"]) == (
        1,
        (chain[1], m16.EOS_TOKEN_ID),
        m16.FinishReason.EOS,
    )
