"""Pins every numbered line of mech-notes/08-cache-aware-scheduling.md."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m08_cache_aware_scheduling as m

R = m.Request
CACHE = m.CACHE


def shape(cache: m.RadixCache) -> list:
    """The radix tree as nested ``(page, [children...])`` lists, in map order."""

    def walk(children: dict) -> list:
        return [(node.block, walk(node.children)) for node in children.values()]

    return walk(cache.root)


def run(eng, limit: int = 200) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops."""

    def watch(rec) -> None:
        assert rec.step < limit, "run() did not stop"

    return eng.run(on_step=watch)


def steps(eng: m.Engine, n: int) -> list[m.StepRecord]:
    return [eng.step() for _ in range(n)]


@contextlib.contextmanager
def bounded_residency() -> Iterator[None]:
    """Turn a residency loop that never ends into a failure instead of a hung run, without a clock.

    Every round of a step's residency loop reclaims: a round that evicts frees a page that stays free
    until the allocation ends the loop (so at most ``num_pages`` such rounds), any other round preempts
    a request, each at most once, or ends the loop; so a step has at most ``pages + requests + 1``.
    """
    ensure, reclaim = m.Engine._ensure_residency, m.Engine._reclaim

    def ensure_counted(self: m.Engine, *args: object) -> object:
        self.residency_rounds = 0
        return ensure(self, *args)

    def reclaim_counted(self: m.Engine, *args: object) -> object:
        self.residency_rounds += 1
        bound = self.pool.num_pages + len(self.requests) + 1
        assert self.residency_rounds <= bound, "a residency loop that never ends"
        return reclaim(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(m.Engine, "_ensure_residency", ensure_counted)
        patch.setattr(m.Engine, "_reclaim", reclaim_counted)
        yield


def synthetic(i: int, n: int) -> list[int]:
    """The CLI's synthetic prompt for the request at position ``i``."""
    return [1000 * i + j for j in range(n)]


def test_m08_n1_prompts_are_token_lists_and_the_constructor_checks_in_order() -> None:
    r = R("a", [5, 6, 7], 2)
    assert r.prompt_len == 3 and r.target == 3
    with pytest.raises(ValueError, match="empty"):
        m.Engine([R("a", [], 1)], 8, 4, 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        m.Engine([R("a", [1], 0)], 8, 4, 8)
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([R("a", [], 0)], 0, 0, 0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([], 0, 4, 8)
    with pytest.raises(ValueError, match="empty"):
        m.Engine([R("a", [], 1)], 8, 0, 0)
    with pytest.raises(ValueError, match="num_pages"):
        m.Engine([R("a", [1], 1)], 8, 0, 0)
    with pytest.raises(ValueError, match="page_size"):
        m.Engine([R("a", [1], 1)], 8, 0, 8)


def test_m08_n2_reuse_follows_admission_and_publish_precedes_sampling() -> None:
    r0 = R("r0", [1, 2, 3, 4, 5], 1)
    r1 = R("r1", [1, 2, 3, 4, 9], 1, arrival_step=1)
    eng = m.Engine([r0, r1], 16, 2, 8)
    s0, s1 = steps(eng, 2)
    # step 0: r0 prefills, publishes its two complete blocks, and only then samples and finishes
    assert s0.admitted == ("r0",) and dict(s0.reused) == {}
    assert dict(s0.published) == {"r0": 2}
    assert dict(s0.finished) == {"r0": m.FinishReason.LENGTH}
    # step 1: r1 is admitted and reuses in the same step; the budget then charges only its tail
    assert s1.admitted == ("r1",)
    assert dict(s1.reused) == {"r1": 4}
    assert s1.scheduled == ("r1",) and dict(s1.executed) == {"r1": 1}
    assert dict(s1.published) == {}
    assert eng.pool.owner[:2] == [CACHE, CACHE]


def test_m08_n3_only_cold_running_requests_reuse_and_they_ask_every_step() -> None:
    r0 = R("r0", [1, 2, 3, 4], 5)
    big = R("big", list(range(50, 59)), 1, arrival_step=1)
    r1 = R("r1", [1, 2, 3, 4, 7], 1)
    r3 = R("r3", [1, 2, 3, 4, 8], 1, arrival_step=2)
    eng = m.Engine([r0, big, r1, r3], 4, 2, 16)
    s0, s1, s2 = steps(eng, 3)
    # step 0: r1 is admitted and cold, but the cache is empty and the budget goes to r0
    assert s0.admitted == ("r0", "r1") and s0.scheduled == ("r0",)
    assert dict(s0.reused) == {}
    # step 1: r1 is still cold and now hits; it gets no budget, yet holds the pages.
    # r3 is WAITING, so it does not ask although its prefix is resident.
    assert dict(s1.reused) == {"r1": 4}
    assert s1.scheduled == ("r0", "big")
    assert (r1.page_table, r1.computed) == ([0, 1], 4)
    # step 2: r1 is no longer cold, so it does not ask again; r3 arrives and reuses
    assert dict(s2.reused) == {"r3": 4}
    assert (r1.page_table, r1.computed) == ([0, 1], 4)
    assert big.computed == 6 and "big" not in s2.reused


def test_m08_n4_reuse_is_capped_below_the_prompt_length() -> None:
    a = R("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    exact = R("exact", [1, 2, 3, 4, 5, 6, 7, 8], 2, arrival_step=1)
    longer = R("longer", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51], 2, arrival_step=1)
    one = R("one", [1, 2, 3], 2, arrival_step=1)
    eng = m.Engine([a, exact, longer, one], 32, 4, 16)
    s0, s1 = steps(eng, 2)
    assert dict(s0.published) == {"a": 2}
    shared = [0, 1]
    # exact has 2 resident blocks but may reuse only floor(7/4) = 1 of them; one shares no whole block
    assert dict(s1.reused) == {"exact": 4, "longer": 8}
    assert exact.page_table[:1] == shared[:1] and longer.page_table[:2] == shared
    assert eng.pool.owner[0] is CACHE and eng.pool.owner[1] is CACHE
    # pages_for(1 token, ps 1) never reuses: (1 - 1) // 1 == 0
    single = R("single", [7], 2, arrival_step=1)
    eng = m.Engine([R("first", [7], 1), single], 8, 1, 4)
    s0, s1 = steps(eng, 2)
    assert dict(s0.published) == {"first": 1}
    assert dict(s1.reused) == {} and dict(s1.executed) == {"single": 1}


def test_m08_n5_the_budget_pays_only_for_what_is_not_cached() -> None:
    a = R("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    exact = R("exact", [1, 2, 3, 4, 5, 6, 7, 8], 2, arrival_step=1)
    longer = R("longer", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51], 2, arrival_step=1)
    eng = m.Engine([a, exact, longer], 32, 4, 16)
    _, s1 = steps(eng, 2)
    assert dict(s1.executed) == {"exact": 4, "longer": 2}
    assert exact.computed == 8 and longer.computed == 10
    # a preempted request that reuses recomputes its generated tokens too (02-preemption-anchor, step 6)
    b = R("b", synthetic(1, 3), 5)
    eng = m.Engine([R("a", synthetic(0, 3), 6), b, R("c", synthetic(2, 4), 3, arrival_step=1)], 8, 2, 6)
    trace = steps(eng, 7)
    assert trace[6].reused["b"] == 2 and trace[6].preempted == ()
    assert trace[6].executed["b"] == 3 + 4 - 2  # prompt + generated - reused
    assert b.generated == 5


def test_m08_n6_reclaim_evicts_exactly_the_shortfall_to_the_back_of_the_free_list() -> None:
    x = R("x", [1, 2, 3], 1)
    y = R("y", [7, 8], 2, arrival_step=1)
    eng = m.Engine([x, y], 8, 1, 4)
    s0 = eng.step()
    assert dict(s0.published) == {"x": 3}
    assert shape(eng.cache) == [(0, [(1, [(2, [])])])]
    assert list(eng.pool.free) == [3]
    s1 = eng.step()
    # y needs 2 pages, 1 is free: k = 1 although the whole chain is unreferenced
    assert s1.evicted == (2,)
    assert shape(eng.cache) == [(0, [(1, [])]), (3, [(2, [])])]
    # the evicted page went to the back of the free list: y took 3 first, then 2
    assert y.page_table == [3, 2]
    assert s1.preempted == ()
    # an evicted page is freed like any other: owner and every slot cleared, so a page that its next
    # holder fills only in part shows nothing of the cached block it held
    x = R("x", [1, 2, 3, 4], 1)
    y = R("y", [7], 2, arrival_step=1)
    eng = m.Engine([x, y], 8, 2, 2)
    eng.step()
    assert (shape(eng.cache), list(eng.pool.free), eng.pool.slots[1]) == ([(0, [(1, [])])], [], [("x", 2), ("x", 3)])
    s1 = eng.step()
    assert (s1.evicted, y.page_table, shape(eng.cache)) == ((1,), [1], [(0, [])])
    assert (eng.pool.owner[1], eng.pool.slots[1]) == ("y", [("y", 0), None])


def _eviction_pressure() -> tuple[m.Engine, list[m.Request]]:
    """04-eviction-pressure."""
    reqs = [
        R("x", [1, 2, 3, 4, 5, 6], 1),
        R("y", [1, 2, 3, 4, 7, 7], 1),
        R("u", [8, 8, 8, 8], 1),
        R("w", [1, 2, 3, 4, 5, 6, 9], 2, arrival_step=1),
        R("z", synthetic(4, 12), 2, arrival_step=1),
    ]
    return m.Engine(reqs, 32, 2, 10), reqs


def test_m08_n7_eviction_takes_the_first_unreferenced_leaf_depth_first() -> None:
    eng, (_, _, _, w, z) = _eviction_pressure()
    eng.step()
    # [0]->[1]->{[2],[5]} and [6]->[7]
    assert shape(eng.cache) == [(0, [(1, [(2, []), (5, [])])]), (6, [(7, [])])]
    assert list(eng.pool.free) == [8, 9, 3, 4]
    s1 = eng.step()
    assert dict(s1.reused) == {"w": 6} and w.page_table[:3] == [0, 1, 2]
    # leaf 2 is referenced by w and skipped; 6 becomes a leaf only after 7 goes
    assert s1.evicted == (5, 7, 6)
    assert z.page_table == [9, 3, 4, 5, 7, 6]
    s2, s3 = steps(eng, 2)
    assert s2.evicted == () and s2.preempted == ("z",)
    # w finished, so leaf 2 is no longer referenced and would go first, but z now reuses its whole
    # cached prompt (D7, N4) and needs one page, which is free: nothing is evicted (D8, N6)
    assert (dict(s3.reused), s3.evicted) == ({"z": 12}, ())


def test_m08_n8_a_victim_is_chosen_only_when_nothing_can_be_evicted() -> None:
    eng, _ = _eviction_pressure()
    eng.step()
    s1 = eng.step()
    # z was an eligible victim (in the work list), but eviction covered the shortfall
    assert s1.evicted and s1.preempted == ()
    assert dict(s1.executed) == {"w": 1, "z": 12}
    s2 = eng.step()
    # now every leaf is referenced (by w and z): nothing is evicted, z is preempted
    assert s2.evicted == () and s2.preempted == ("z",)


def test_m08_n8_victim_eligibility_is_per_request_not_per_id() -> None:
    # request ids need not be unique; two requests share "x" and only the first is scheduled
    a, x1, x2 = R("a", [1, 2, 3, 4], 4), R("x", [5, 6, 7, 8], 4), R("x", [9, 9, 9, 9], 4)
    eng = m.Engine([a, x1, x2], 8, 4, 1)
    with bounded_residency():
        s0 = eng.step()
    # x2 holds no pages and has no work item: not eligible; x1 (in the work list) is the victim
    assert s0.scheduled == ("a", "x") and s0.preempted == ("x",)
    assert dict(s0.executed) == {"a": 4} and a.page_table == [0]
    assert (x1.computed, x2.computed, x2.page_table) == (0, 0, [])


def test_m08_n9_a_victim_keeps_its_cache_pages_in_the_tree() -> None:
    a = R("a", [1, 2, 3], 4)
    b = R("b", [5, 6, 7], 4)
    eng = m.Engine([a, b], 8, 2, 4)
    steps(eng, 2)
    assert (b.page_table, eng.pool.owner[2], eng.pool.owner[3]) == ([2, 3], CACHE, "b")
    s2 = eng.step()
    assert s2.preempted == ("b",) and s2.evicted == ()
    # only b's private page 3 was released (and a took it); its cache page 2 stays in the tree
    assert (b.page_table, b.computed, b.generated) == ([], 0, 2)
    assert a.page_table == [0, 1, 3] and eng.pool.owner[3] == "a"
    assert eng.pool.owner[2] is CACHE and eng.cache.match(b.prompt_keys) == [2]
    assert eng.pool.slots[2] == [("b", 0), ("b", 1)]
    # 02-preemption-anchor, step 2: c holds only cache pages; preempting it frees nothing,
    # but its blocks are unreferenced at once and are evicted deepest first in the same step
    c = R("c", synthetic(2, 4), 3, arrival_step=1)
    eng = m.Engine([R("a", synthetic(0, 3), 6), R("b", synthetic(1, 3), 5), c], 8, 2, 6)
    steps(eng, 2)
    assert c.page_table == [4, 5] and eng.pool.owner[4:6] == [CACHE, CACHE] and not eng.pool.free
    s2 = eng.step()
    assert s2.preempted == ("c",) and s2.evicted == (5, 4)


def test_m08_n10_a_reused_page_is_never_written_by_its_reuser() -> None:
    a = R("a", [1, 2, 3, 4, 5], 1)
    b = R("b", [1, 2, 3, 4, 6, 7], 2, arrival_step=1)
    eng = m.Engine([a, b], 16, 2, 8)
    eng.step()
    before = [list(eng.pool.slots[p]) for p in (0, 1)]
    assert before == [[("a", 0), ("a", 1)], [("a", 2), ("a", 3)]]
    s1 = eng.step()
    assert dict(s1.reused) == {"b": 4} and dict(s1.executed) == {"b": 2}
    assert [eng.pool.slots[p] for p in (0, 1)] == before
    assert eng.pool.slots[b.page_table[2]] == [("b", 4), ("b", 5)]


def test_m08_n11_complete_prompt_blocks_are_published_at_every_chunk() -> None:
    r = R("r", [1, 2, 3, 4, 5, 6, 7], 1)
    eng = m.Engine([r], 3, 2, 8)
    s0 = eng.step()
    assert dict(s0.published) == {"r": 1}  # computed 3: one complete block
    assert eng.pool.owner[:2] == [CACHE, "r"]
    s1 = eng.step()
    assert dict(s1.published) == {"r": 2}  # computed 6: blocks 1 and 2 are new
    assert eng.pool.owner[:4] == [CACHE, CACHE, CACHE, None]
    s2 = eng.step()
    assert dict(s2.published) == {}  # computed 7: the partial last block has no key
    assert shape(eng.cache) == [(0, [(1, [(2, [])])])]
    assert dict(s2.finished) == {"r": m.FinishReason.LENGTH}


def resident(eng: m.Engine) -> dict[m.PrefixKey, int]:
    """Every key in the radix tree, with its page."""
    found, stack = {}, [eng.cache.root]
    while stack:
        for key, node in stack.pop().items():
            found[key] = node.block
            stack.append(node.children)
    return found


def publish_step(eng: m.Engine) -> m.StepRecord:
    """``eng.step()``, checking N11 against the tree before it (request ids are unique here).

    Walking the post-preemption work (``executed``, in work order), each request's first
    ``c = ⌊min(computed, prompt_len) / page_size⌋`` prompt keys are looked up in the tree as it stands
    after this step's evictions and the publishes before it; the missing ones are its new blocks.
    ``published`` must be exactly that, in that order; afterwards those keys are cached, on
    cache-owned pages, and a live request's table leads with the cached chain (its own pages or,
    where an earlier item won, the adopted ones).
    """
    before = resident(eng)
    t = eng.step()
    by_id = {r.request_id: r for r in eng.requests}
    cached = {key for key, page in before.items() if page not in t.evicted}
    ps = eng.pool.page_size
    expected = {}
    for rid in t.executed:
        r = by_id[rid]
        keys = r.prompt_keys[: min(r.computed, r.prompt_len) // ps]
        have = next((i for i, key in enumerate(keys) if key not in cached), len(keys))
        if have < len(keys):
            expected[rid] = len(keys) - have
            cached.update(keys[have:])
        pages = eng.cache.match(keys)
        assert len(pages) == len(keys) and all(eng.pool.owner[p] is CACHE for p in pages), rid
        if r.state is m.RequestState.RUNNING:
            assert r.page_table[: len(keys)] == pages, rid
    assert list(t.published.items()) == list(expected.items()), (dict(t.published), expected)
    assert not set(t.published) & set(t.preempted)
    return t


def test_m08_n11_publish_follows_the_post_preemption_work_order() -> None:
    # z and a (list order; ids not in alphabetical order) arrive together and compute the same two blocks
    # [1, 2], [3, 4] in one step, while v, scheduled behind them, is preempted to make room
    z = R("z", [1, 2, 3, 4, 5], 2, arrival_step=1)
    a = R("a", [1, 2, 3, 4, 6, 7], 2, arrival_step=1)
    v = R("v", [9, 9, 9], 4)
    eng = m.Engine([z, a, v], 16, 2, 7)
    s0 = publish_step(eng)
    assert (dict(s0.published), v.page_table, list(eng.pool.free)) == ({"v": 1}, [0, 1], [2, 3, 4, 5, 6])
    s1 = publish_step(eng)
    assert (s1.scheduled, s1.preempted, list(s1.executed)) == (("z", "a", "v"), ("v",), ["z", "a"])
    # z, first in the work, publishes the shared blocks; a adopts them, frees its copies 5 and 6 to the
    # back of the free list, and publishes only its own third block; v, preempted, publishes nothing
    assert list(s1.published.items()) == [("z", 2), ("a", 1)]
    assert (z.page_table, a.page_table, list(eng.pool.free)) == ([2, 3, 4], [2, 3, 1], [5, 6])
    assert shape(eng.cache) == [(0, []), (2, [(3, [(1, [])])])]
    s2 = publish_step(eng)
    assert (dict(s2.reused), dict(s2.published)) == ({"v": 2}, {})


# Shared prompts on a tight pool; arrivals close together with a large budget make several requests
# publish in the step of a preemption, and same-step publishers of one block (D2) common.
_PUBLISHERS = st.one_of(
    workloads(prompts="shared", pool="tight", max_requests=5, max_arrival=1, budget="large"),
    workloads(prompts="shared", pool="tight", min_requests=2, max_requests=5, max_arrival=2),
)


@settings(max_examples=80, deadline=None)
@given(w=_PUBLISHERS, data=st.data())
def test_m08_n11_every_step_publishes_in_post_preemption_work_order(w: dict, data: st.DataObject) -> None:
    eng = build(m, w, validate=False)
    # ids in shuffled order, so that list order (the work order) is not also the order of the ids
    for r, rid in zip(eng.requests, data.draw(st.permutations([r.request_id for r in eng.requests]))):
        r.request_id = rid
    for _ in range(300):
        if all(r.state is m.RequestState.FINISHED for r in eng.requests):
            return
        publish_step(eng)
    raise AssertionError("the run did not stop")


def test_m08_n12_blocks_holding_generated_tokens_are_never_published() -> None:
    r = R("r", [1, 2, 3], 4)
    eng = m.Engine([r], 8, 2, 8)
    trace = run(eng)
    assert [dict(s.published) for s in trace] == [{"r": 1}, {}, {}, {}]
    assert r.computed == 6  # positions 0..5: blocks 1 and 2 are complete but hold generated tokens
    assert eng.cache.size == 1 and shape(eng.cache) == [(0, [])]
    assert list(eng.pool.free) == [3, 4, 5, 6, 7, 1, 2]


def test_m08_n13_the_second_publisher_adopts_the_cached_pages() -> None:
    # 10-d2-publish-dedupe
    r0 = R("r0", [1, 2, 3, 4], 1)
    r1 = R("r1", [1, 2, 3, 4, 5, 6, 7, 8], 4)
    eng = m.Engine([r0, r1], 16, 2, 6)
    s0 = eng.step()
    assert dict(s0.published) == {"r0": 2, "r1": 2}
    assert r1.page_table == [0, 1, 4, 5]
    assert list(eng.pool.free) == [2, 3]
    assert shape(eng.cache) == [(0, [(1, [(4, [(5, [])])])])]
    rest = run(eng)
    assert [s.evicted for s in rest] == [(), (), ()] and all(s.preempted == () for s in rest)
    assert r1.generated == 4 and r1.finish_reason is m.FinishReason.LENGTH
    # identical twins: the twin inserts nothing, adopts both blocks, frees its copies in page-table order
    a = R("a", [1, 2, 3, 4, 5], 2)
    twin = R("twin", [1, 2, 3, 4, 5], 2)
    eng = m.Engine([a, twin], 16, 2, 8)
    s0 = eng.step()
    assert dict(s0.published) == {"a": 2}
    assert (a.page_table, twin.page_table) == ([0, 1, 2], [0, 1, 5])
    assert list(eng.pool.free) == [6, 7, 3, 4]


def test_m08_n14_finishing_frees_only_private_pages_in_page_table_order() -> None:
    r = R("r", [1, 2, 3, 4, 5], 3)
    eng = m.Engine([r], 8, 2, 8)
    trace = run(eng)
    assert len(trace) == 3
    assert r.page_table == [] and r.computed == 7
    # pages 0 and 1 hold the published prompt blocks; 2 and 3 were private
    assert list(eng.pool.free) == [4, 5, 6, 7, 2, 3]
    assert eng.pool.owner[:4] == [CACHE, CACHE, None, None]
    assert shape(eng.cache) == [(0, [(1, [])])]


@st.composite
def fitting_workloads(draw: st.DrawFn) -> dict:
    page_size = draw(st.integers(1, 4))
    num_pages = draw(st.integers(1, 8))
    base = draw(st.lists(st.integers(1, 3), min_size=12, max_size=12))
    requests = []
    for i in range(draw(st.integers(1, 5))):
        room = num_pages * page_size  # prompt_len + max_new_tokens - 1 must fit the pool
        prompt_len = draw(st.integers(1, min(room, 10)))
        own = draw(st.lists(st.integers(1, 3), min_size=prompt_len, max_size=prompt_len))
        tokens = base[:prompt_len] if prompt_len <= 12 and draw(st.booleans()) else own
        requests.append(
            {
                "request_id": f"r{i}",
                "tokens": tokens,
                "max_new_tokens": draw(st.integers(1, min(6, room - prompt_len + 1))),
                "arrival_step": draw(st.integers(0, 4)),
                "eos_after": draw(st.none() | st.integers(0, 5)),
            }
        )
    return {
        "max_step_tokens": draw(st.integers(1, 12)),
        "page_size": page_size,
        "num_pages": num_pages,
        "requests": requests,
    }


# 10-d2-publish-dedupe: the original design raised OutOfPages at step 1
_D2 = {
    "max_step_tokens": 16,
    "page_size": 2,
    "num_pages": 6,
    "requests": [
        {"request_id": "r0", "tokens": [1, 2, 3, 4], "max_new_tokens": 1},
        {"request_id": "r1", "tokens": [1, 2, 3, 4, 5, 6, 7, 8], "max_new_tokens": 4},
    ],
}


@settings(max_examples=300, deadline=None)
@example(_D2)
@given(fitting_workloads())
def test_m08_n15_out_of_pages_is_unreachable_when_every_request_fits(spec: dict) -> None:
    reqs = [R(**r) for r in spec["requests"]]
    for r in reqs:
        assert m.pages_for(r.prompt_len + r.max_new_tokens - 1, spec["page_size"]) <= spec["num_pages"]
    eng = m.Engine(reqs, spec["max_step_tokens"], spec["page_size"], spec["num_pages"])
    for _ in range(1000):
        if all(r.state is m.RequestState.FINISHED for r in reqs):
            break
        eng.step()  # an OutOfPages here fails the property
        eng.check_invariants()
    assert all(r.state is m.RequestState.FINISHED for r in reqs)


def test_m08_n16_prefix_caching_off_is_m05() -> None:
    from mechserve.spec import m05_preemption as m05

    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6, 7]]
    on = m.Engine([R(f"r{i}", list(p), 3) for i, p in enumerate(prompts)], 6, 2, 7)
    off = m.Engine([R(f"r{i}", list(p), 3) for i, p in enumerate(prompts)], 6, 2, 7, prefix_caching=False)
    ref = m05.Engine([m05.Request(f"r{i}", len(p), 3) for i, p in enumerate(prompts)], 6, 2, 7)
    assert any(t.reused for t in on.run())  # the workload does share prefixes
    trace = off.run()
    assert not any(t.reused or t.published or t.evicted for t in trace)
    assert off.cache.size == 0 and m.CACHE not in off.pool.owner
    expected = [t.to_json() for t in ref.run()]
    assert [{k: t.to_json()[k] for k in expected[0]} for t in trace] == expected
    assert off.summary() == ref.summary()


def _two_prompts_tight() -> tuple[m.Engine, list[m.Request]]:
    """Issue 31's reproducer: 6 pages of 4 tokens, two 8-token prompts, 12 new tokens each."""
    reqs = [R("a", [1, 2, 3, 4, 5, 6, 7, 8], 12), R("b", [11, 12, 13, 14, 15, 16, 17, 18], 12)]
    return m.Engine(reqs, 16, 4, 6), reqs


def test_m08_n4_a_preempted_request_reuses_every_cached_prompt_block() -> None:
    eng, (_, b) = _two_prompts_tight()
    trace = steps(eng, 7)
    assert trace[5].preempted == ("b",) and b.generated == 5  # b keeps its 5 tokens, its 2 prompt blocks stay cached
    # D7: b's target (8 + 5) runs past its prompt, so both cached prompt blocks are usable (the original
    # design reused 1, (8 - 1) // 4, and recomputed a fully cached block)
    assert dict(trace[6].reused) == {"b": 8}
    fresh = m.Engine([R("c", [1, 2, 3, 4, 5, 6, 7, 8], 1)], 16, 4, 6)
    fresh.cache = eng.cache  # a request that has not sampled still recomputes its last prompt token
    assert dict(fresh.step().reused) == {"c": 4}


def test_m08_n6_an_eviction_that_cannot_spare_a_preemption_does_not_happen() -> None:
    eng, (a, b) = _two_prompts_tight()
    trace = run(eng)
    # D8: while a decodes, b does not fit: b is preempted each step, and no step evicts before its last
    # preemption (the original evicted b's own second prompt block, then preempted b anyway); once b is
    # out, the anchor a may still need a page that only an eviction gives
    for rec in trace:
        lines = list(rec.explain)
        evictions = [i for i, line in enumerate(lines) if "evicted unreferenced" in line]
        preemptions = [i for i, line in enumerate(lines) if "was preempted" in line]
        assert not evictions or not preemptions or min(evictions) > max(preemptions), lines
    assert any(rec.evicted and rec.preempted for rec in trace)  # the case happens: evict after the victim
    assert (a.state, b.state) == (m.RequestState.FINISHED, m.RequestState.FINISHED)
    assert (a.generated, b.generated) == (12, 12)
