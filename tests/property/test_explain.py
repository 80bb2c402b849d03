"""The explanation tells the truth, on the top rungs (m13, and m14 with its forced runs).

``StepRecord.explain`` is what ``mechserve demo --explain`` and the trace viewer print: one sentence per
decision.  Every sentence of every step must be one of the kinds the engine says (``KINDS``, matched
whole), and what it states must be what the step did: the ids, reasons and counts of the record, the
pages each request's table gained or lost and who owned them, the positions computed, what was evicted,
published, adopted and given back.  Each kind also appears exactly when its decision was taken (a
preemption has its sentence, a request with nothing cut has none).

Mutation testing (docs/mutation.md) found that no test read ``explain``: a sentence dropped, replaced by
``None`` or stating a wrong count lived.  The property runs random workloads (tight pools, speculation,
forced runs, the door's limits, stops from outside, aborts, the shared-prefix hold);
``test_the_scenarios_say_every_kind_of_sentence`` checks the same on small scenarios that between them
say every kind, so the property is never vacuous.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI
from test_m14_properties import forced_workloads

from mechserve.conformance.strategies import build, workloads

RUNGS = ["m13_output_caching", "m14_forced_runs", "m16_request_draft_lengths"]
FORCED_KINDS = ("forced", "forced_finished")  # m14's own sentences
LIMIT_KINDS = ("limited",)  # m16's own sentence

_ID = r"(?P<rid>[^\s']+)"
_PAGES = r"\[(?:\d+(?:, \d+)*)?\]"
KINDS: dict[str, re.Pattern[str]] = {
    kind: re.compile(pattern)
    for kind, pattern in {
        "rejected": rf"{_ID} was rejected at the door: (?P<reason>[A-Z_]+)\.",
        "aborted": rf"{_ID} was aborted\.",
        "admitted": rf"{_ID} arrived \(arrival_step (?P<arrival>-?\d+)\) and was admitted\.",
        "zero": rf"{_ID} asked for 0 tokens and finished at once\.",
        "wait": r"(?P<k>\d+) arrived request\(s\) wait: (?P<n>\d+) running is the max_running limit\.",
        "held": rf"{_ID} is held back: (?P<p>[^\s']+) is still computing the (?P<s>\d+) prompt block\(s\) "
        r"they share \((?P<h>\d+) cached\); (?P=rid) will reuse them once they are published\.",
        "reused": rf"{_ID} found (?P<hit>\d+) cached block\(s\) of its (?P<seq>\w+) and reused (?P<u>\d+) "
        rf"\(pages (?P<pages>{_PAGES})\): (?P<t>\d+) token\(s\) it need not compute\.",
        "draft": rf"{_ID} is caught up and asks for (?P<d>\d+) guess\(es\)"
        r"(?P<capped> \(capped so it cannot pass max_new_tokens\))?\.",
        "limited": rf"{_ID} is caught up and may ask for (?P<d>\d+) guess\(es\) but its draft limit is "
        r"(?P<l>\d+): it asks for (?P=l)\.",
        "cut": rf"{_ID} was cut to (?P<take>\d+) of the (?P<owed>\d+) token\(s\) it owes: the budget ran out\.",
        "evicted": r"(?P<need>\d+) page\(s\) needed but only (?P<free>\d+) free: "
        rf"evicted unreferenced cache page\(s\) (?P<pages>{_PAGES}), deepest first\.",
        "preempted": r"(?P<need>\d+) page\(s\) needed but only (?P<free>\d+) free and (?P<evictable>\d+) "
        rf"evictable cache page\(s\): {_ID} \(the eligible request admitted last\) was preempted\.",
        "took": rf"{_ID} took free page\(s\) (?P<pages>{_PAGES}) to back positions up to (?P<last>\d+)\.",
        "computed": rf"{_ID} computed (?P<n>\d+) token\(s\), positions (?P<a>-?\d+)\.\.(?P<b>-?\d+)\.",
        "verdict": rf"{_ID}'s executor accepted (?P<x>\d+) of (?P<d>\d+) guess\(es\), (?P<a>\d+) kept; "
        rf"(?P<r>-?\d+) rolled back(?:, freeing tail page\(s\) (?P<pages>{_PAGES}))?\.",
        "adopted": rf"{_ID}'s block\(s\) were already cached: it adopted the cached pages and freed its copies "
        rf"(?P<pages>{_PAGES})\.",
        "published": rf"{_ID} published (?:prompt block\(s\)|block\(s\), (?P<g>\d+) holding generated tokens,) "
        rf"on page\(s\) (?P<pages>{_PAGES}) to the cache\.",
        "finished": rf"{_ID} finished \((?P<reason>[A-Z]+)\) after (?P<g>\d+) token\(s\)\.",
        "forced": rf"{_ID}'s grammar forced (?P<k>\d+) id\(s\) after its sample"
        r"(?: \(of (?P<of>\d+); the run was cut\))?: appended without sampling, computed in a later step\.",
        "forced_finished": rf"{_ID} finished \((?P<reason>[A-Z]+)\) inside a forced run after (?P<g>\d+) token\(s\)\.",
        "stopped": rf"{_ID} was stopped from outside after (?P<keep>\d+) of the (?P<n>\d+) id\(s\) it appended "
        r"\(STOP, (?P<g>\d+) token\(s\)\)\.",
        "released": rf"{_ID} gave back private page\(s\) (?P<pages>{_PAGES})\.",
    }.items()
}


def rung(name: str) -> Any:
    return importlib.import_module(f"mechserve.spec.{name}")


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def page_list(text: str | None) -> list[int]:
    return [int(p) for p in re.findall(r"\d+", text or "")]


@dataclass
class Snapshot:
    """What the test reads of the engine at one moment (copies: the engine goes on changing)."""

    table: dict[str, list[int]]
    computed: dict[str, int]
    generated: dict[str, int]
    remaining: dict[str, int]
    owner: list[Any]
    running: list[str]
    cached: dict[str, int]  # waiting requests: how many leading prompt blocks the cache holds


def snapshot(eng: Any) -> Snapshot:
    reqs = eng.requests
    return Snapshot(
        table={r.request_id: list(r.page_table) for r in reqs},
        computed={r.request_id: r.computed for r in reqs},
        generated={r.request_id: r.generated for r in reqs},
        remaining={r.request_id: r.remaining for r in reqs},
        owner=list(eng.pool.owner),
        running=[r.request_id for r in eng.running],
        cached={r.request_id: len(eng.cache.match(r.prompt_keys)) for r in reqs if r.state.value == "WAITING"},
    )


def block_index(eng: Any) -> dict[int, int]:
    """Each cached page's block index (its depth in the radix tree)."""
    depth: dict[int, int] = {}
    stack = [(node, 0) for node in eng.cache.root.values()]
    while stack:
        node, d = stack.pop()
        depth[node.block] = d
        stack.extend((child, d + 1) for child in node.children.values())
    return depth


def check_step(
    mod: Any,
    eng: Any,
    rec: Any,
    prev: Snapshot,
    pre: Snapshot,
    mid: Snapshot,
    plan: tuple[Any, ...],
    outcomes: tuple[Any, ...],
    stopped: dict[str, tuple[int, ...]],
) -> set[str]:
    """Check one step's sentences against what it did; return the kinds it said.

    ``prev``: the engine after the previous step (before the aborts and offers between the steps);
    ``pre``: just before ``schedule``; ``mid``: between ``schedule`` and ``commit``; ``stopped``: the
    requests a stop from outside ended in this step, with the ids each had appended."""
    ps = eng.pool.page_size
    by_id = {r.request_id: r for r in eng.requests}
    items = {item.request_id: item for item in plan}
    outs = {out.request_id: out for out in outcomes}
    said: dict[str, list[dict[str, str]]] = {kind: [] for kind in KINDS}
    for line in rec.explain:
        assert isinstance(line, str), f"step {rec.step}: {line!r} is not a sentence"
        found = [(kind, m) for kind, pattern in KINDS.items() if (m := pattern.fullmatch(line))]
        assert len(found) == 1, f"step {rec.step}: not one known kind of sentence: {line!r}"
        said[found[0][0]].append(found[0][1].groupdict())

    def rids(kind: str) -> list[str]:
        return [g["rid"] for g in said[kind]]

    # no request has computed a position past its known ids (a stop from outside lowers both)
    assert all(r.computed <= r.prompt_len + r.generated for r in eng.requests), rec.step

    # the door, aborts and admission
    assert [(g["rid"], g["reason"]) for g in said["rejected"]] == [(rid, why.value) for rid, why in rec.rejected]
    assert rids("aborted") == list(rec.aborted)
    assert rids("admitted") == list(rec.admitted)
    for g in said["admitted"]:
        assert int(g["arrival"]) == by_id[g["rid"]].arrival_step
    assert rids("zero") == [rid for rid in rec.admitted if by_id[rid].max_new_tokens == 0]
    waiting = len(eng.due) - len(said["held"])  # due requests kept back by max_running, not by the hold
    assert [(int(g["k"]), int(g["n"])) for g in said["wait"]] == ([(waiting, eng.max_running)] if waiting else [])
    for g in said["held"]:
        r, p, s, h = by_id[g["rid"]], by_id[g["p"]], int(g["s"]), int(g["h"])
        usable = (r.prompt_len - 1) // ps
        assert eng.hold_shared_prefix and any(d is r for d in eng.due) and g["p"] in mid.running
        assert h == min(pre.cached[r.request_id], usable) < s <= usable
        assert p.prompt_keys[s - 1] == r.prompt_keys[s - 1] and pre.computed[p.request_id] < s * ps

    # reuse, drafts and the budget
    assert rids("reused") == list(rec.reused)
    for g in said["reused"]:
        rid, hit, u, t = g["rid"], int(g["hit"]), int(g["u"]), int(g["t"])
        target = by_id[rid].prompt_len + pre.generated[rid]
        assert rec.reused[rid] == t == u * ps and u == min(hit, (target - 1) // ps)
        assert g["seq"] == ("tokens" if eng.output_caching else "prompt")
        if rid not in rec.preempted:
            assert page_list(g["pages"]) == mid.table[rid][:u]
    drafters = []
    for rid in mid.running:
        r, done = by_id[rid], pre.generated[rid]
        caught_up = done >= 1 and rec.reused.get(rid, pre.computed[rid]) == r.prompt_len + done - 1
        if caught_up and min(eng.spec_len, r.max_new_tokens - done - 1) > 0:
            drafters.append(rid)
    spoken = rids("draft") + rids("limited")  # m16: a request whose limit cut its window says "limited"
    assert len(set(spoken)) == len(spoken) and sorted(spoken, key=drafters.index) == drafters
    for g in said["limited"]:
        r, d, lim = by_id[g["rid"]], int(g["d"]), int(g["l"])
        assert d == min(eng.spec_len, r.max_new_tokens - pre.generated[r.request_id] - 1) and lim < d
    for g in said["draft"]:
        r, d = by_id[g["rid"]], int(g["d"])
        assert d == min(eng.spec_len, r.max_new_tokens - pre.generated[r.request_id] - 1)
        assert (g["capped"] is not None) == (d < eng.spec_len)
    # only the last request scheduled can be cut; if it was then preempted, its item is gone
    last = rec.scheduled[-1] if rec.scheduled else None
    if last in items:
        assert rids("cut") == ([last] if items[last].num_tokens < mid.remaining[last] else [])
    else:
        assert rids("cut") in ([], [last])
    for g in said["cut"]:
        take, owed = int(g["take"]), int(g["owed"])
        assert take < owed
        if g["rid"] in items:
            assert (take, owed) == (items[g["rid"]].num_tokens, mid.remaining[g["rid"]])

    # residency: evictions, preemptions and pages taken
    assert [p for g in said["evicted"] for p in page_list(g["pages"])] == list(rec.evicted)
    for g in said["evicted"]:
        need, free = int(g["need"]), int(g["free"])
        assert free < need and len(page_list(g["pages"])) == need - free
    assert rids("preempted") == list(rec.preempted)
    for g in said["preempted"]:
        assert int(g["need"]) > int(g["free"]) + int(g["evictable"])
    for rid in rec.preempted:
        if any(pre.owner[p] == rid for p in pre.table[rid]):
            assert rid in rids("released"), f"step {rec.step}: {rid} was preempted with private pages"
    took = {g["rid"]: g for g in said["took"]}
    assert len(took) == len(said["took"])
    for rid, item in items.items():
        new = [p for p in mid.table[rid] if mid.owner[p] == rid and p not in pre.table[rid]]
        assert (rid in took) == bool(new), (rid, new)
        if new:
            assert page_list(took[rid]["pages"]) == new
            assert int(took[rid]["last"]) == item.start_position + item.num_tokens - 1
            assert len(mid.table[rid]) == pages_for(item.start_position + item.num_tokens, ps)
    assert took.keys() <= items.keys()

    # execution and the verdicts
    assert rids("computed") == list(rec.executed)
    for g in said["computed"]:
        item, n = items[g["rid"]], int(g["n"])
        assert n == rec.executed[g["rid"]] == item.num_tokens
        assert (int(g["a"]), int(g["b"])) == (item.start_position, item.start_position + n - 1)
    assert rids("verdict") == [rid for rid, d in rec.drafted.items() if d]
    assert all(by_id[rid].draft_len == 0 for rid in rec.drafted), "a judged window still asks for guesses"
    for g in said["verdict"]:
        rid, x, d, a, r = g["rid"], int(g["x"]), int(g["d"]), int(g["a"]), int(g["r"])
        assert d == rec.drafted[rid] and x == outs[rid].accepted_draft_tokens and a <= x and r == d - a
        if rid not in stopped:
            assert (a, r) == (rec.accepted[rid], rec.rolled_back[rid])
        item, table = items[rid], mid.table[rid]
        frontier = item.start_position + item.num_tokens - (d - a)
        freed = [p for p in reversed(table[pages_for(frontier, ps) :]) if mid.owner[p] == rid]
        assert page_list(g["pages"]) == freed and (g["pages"] is None) == (not freed)

    # publishing
    assert rids("published") == list(rec.published)
    depth = block_index(eng)
    for g in said["published"]:
        rid, pages = g["rid"], page_list(g["pages"])
        assert rec.published[rid] == len(pages) and all(eng.pool.owner[p] is mod.CACHE for p in pages)
        generated = sum(depth[p] >= by_id[rid].prompt_len // ps for p in pages)
        assert g["g"] == (str(generated) if generated else None)
    for g in said["adopted"]:
        pages = page_list(g["pages"])
        assert pages and all(mid.owner[p] == g["rid"] and eng.pool.owner[p] is None for p in pages)

    # how requests ended
    ended = rids("zero") + rids("finished") + rids("forced_finished")
    assert len(ended) == len(set(ended)) and set(rec.finished) == set(ended) | set(stopped)
    for g in said["finished"] + said["forced_finished"]:
        if g["rid"] not in stopped:
            assert rec.finished[g["rid"]].value == g["reason"]
            assert int(g["g"]) == by_id[g["rid"]].generated
    assert rids("forced") == list(getattr(rec, "forced", {}))
    for g in said["forced"]:
        rid, k, forced = g["rid"], int(g["k"]), outs[g["rid"]].forced
        assert (k < int(g["of"]) == len(forced)) if g["of"] else k == len(forced)
        if rid not in stopped:
            assert rec.forced[rid] == k
    assert rids("stopped") == list(stopped)
    for g in said["stopped"]:
        rid = g["rid"]
        assert int(g["keep"]) == len(rec.tokens[rid]) and int(g["n"]) == len(stopped[rid])
        assert int(g["g"]) == by_id[rid].generated and rec.finished[rid] is mod.FinishReason.STOP
    left = set(rec.finished) | set(rec.aborted) | set(rec.preempted)
    for g in said["released"]:
        rid, pages = g["rid"], page_list(g["pages"])
        assert pages and rid in left
        for p in pages:
            assert p in prev.table.get(rid, []) + mid.table[rid] and rid in (prev.owner[p], mid.owner[p])
            assert eng.pool.owner[p] != rid
    return {kind for kind, found in said.items() if found}


def explained_run(
    mod: Any,
    eng: Any,
    stop_after: dict[str, tuple[int, int]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    offers: dict[int, list[Any]] | None = None,
) -> set[str]:
    """Run ``eng`` by its halves to the end, checking every step's sentences; return the kinds said.

    ``stop_after``: request id -> ``(n, keep)``: the ``n``-th time (from 0) it appends ids, a stop from outside
    ends it after ``keep`` of them; ``aborts`` and ``offers``: step -> request ids to abort, requests to
    offer, before it."""
    stop_after, aborts, offers = stop_after or {}, aborts or {}, offers or {}
    kinds: set[str] = set()
    appended: dict[str, int] = {}
    stopped: dict[str, tuple[int, ...]] = {}  # this step's stops: request id -> the ids it had appended

    def stop(rid: str, ids: tuple[int, ...]) -> int | None:
        n = appended[rid] = appended.get(rid, -1) + 1
        if rid not in stop_after or stop_after[rid][0] != n:
            return None
        stopped[rid] = ids
        return min(stop_after[rid][1], len(ids))

    prev = snapshot(eng)
    while eng.waiting or eng.due or eng.running or eng._rejected or eng._aborted or eng.step_counter in offers:
        assert eng.step_counter < 500, "did not stop"
        for rid in aborts.get(eng.step_counter, []):
            eng.abort(rid)
        for r in offers.get(eng.step_counter, []):
            eng.add_request(r)
        pre = snapshot(eng)
        plan = eng.schedule()
        mid = snapshot(eng)
        outcomes = eng.executor.execute(plan)
        stopped.clear()
        rec = eng.commit(outcomes, stop)
        eng.check_invariants()
        kinds |= check_step(mod, eng, rec, prev, pre, mid, plan, outcomes, stopped)
        prev = snapshot(eng)
    return kinds


FORCED = forced_workloads().map(lambda pair: pair[1])
WORKLOADS = st.one_of(
    workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), max_new=6),
    workloads(prompts="shared", pool="tight", spec_len=(0, 2), scripts=True, output_caching=True, max_new=8),
    # m16: draft limit scripts (dropped below m16)
    workloads(prompts="shared", pool="tight", spec_len=(1, 3), scripts=True, draft_limits=True, max_new=8),
    workloads(admission=True, prompts="mixed", spec_len=(0, 2), scripts=True, output_caching="any"),
)


@CI
@pytest.mark.parametrize("name", RUNGS)
@given(hold=st.booleans(), data=st.data())
def test_every_sentence_is_a_known_kind_and_states_what_the_step_did(name: str, hold: bool, data: Any) -> None:
    mod = rung(name)
    # half of m14's workloads force runs (m13 builds the same workloads without their forced scripts)
    w = data.draw(FORCED if data.draw(st.booleans()) else WORKLOADS)
    eng = build(mod, w, validate=False)
    eng.hold_shared_prefix = hold
    ids = [r.request_id for r in eng.requests]
    if ids:
        cuts = st.tuples(st.integers(0, 3), st.integers(0, 4))
        stop_after = data.draw(st.dictionaries(st.sampled_from(ids), cuts, max_size=2))
        aborts = data.draw(st.dictionaries(st.integers(0, 6), st.lists(st.sampled_from(ids), max_size=1)))
    else:
        stop_after, aborts = {}, {}
    explained_run(mod, eng, stop_after, aborts)


def scenarios(mod: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Small engines (with their stops, aborts and offers) that between them say every kind of sentence."""
    R = mod.Request
    door = mod.Engine(
        [
            R("e", [], 4),  # rejected: empty prompt
            R("z", [1, 2], 0),  # admitted, finished at once
            R("a", [1, 2, 3, 4, 5], 8, accept_script=[0]),  # its first window rolls back, freeing a tail page
            R("b", [6, 7, 8], 6),  # cut by the budget at step 0, aborted before step 2
            R("c", [9, 9, 9], 3),  # waits for a running slot, then is stopped from outside
        ],
        max_step_tokens=6,
        page_size=2,
        num_pages=12,
        spec_len=2,
        max_running=2,
    )
    # pages of 4, budget 3: p is computing block 0 when q arrives; q is held, then reuses it
    hold = mod.Engine([R("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)], 3, 4, 16, hold_shared_prefix=True)
    # two 8-token prompts, 12 new tokens each, 6 pages of 4: the pool runs out (evict, then preempt)
    tight = mod.Engine([R("x", list(range(1, 9)), 12), R("y", list(range(11, 19)), 12)], 16, 4, 6)
    # the same prompt twice in one step: x publishes its blocks, y adopts them
    twins = mod.Engine([R("x", [1, 2, 3, 4, 5], 2), R("y", [1, 2, 3, 4, 5], 2)], 16, 2, 16)
    # output caching: blocks holding generated tokens are published
    outputs = mod.Engine([R("o", [1, 2, 3], 6)], 16, 2, 16, output_caching=True)
    cases = [
        (door, {"stop_after": {"c": (0, 0)}, "aborts": {2: ["b"]}}),
        (hold, {"offers": {1: [R("q", [1, 2, 3, 4, 5], 1)]}}),
        (tight, {}),
        (twins, {}),
        (outputs, {}),
    ]
    if "forced_script" in mod.Request.__dataclass_fields__:
        # m14: f's grammar forces 3 ids after its first (kept whole); g's forces 3 where only 2 fit max_new_tokens
        forced = mod.Engine(
            [R("f", [1, 2, 3], 8, forced_script={0: (7, 8, 9)}), R("g", [4, 5, 6], 3, forced_script={0: (7, 8, 9)})],
            16,
            2,
            16,
        )
        cases.append((forced, {}))
    if "draft_limit_script" in mod.Request.__dataclass_fields__:
        # m16: h's script limits its first window to 1 of the 3 guesses spec_len allows
        cases.append((mod.Engine([R("h", [1, 2, 3], 6, draft_limit_script=[1])], 16, 2, 16, spec_len=3), {}))
    return cases


@pytest.mark.parametrize("name", RUNGS)
def test_the_scenarios_say_every_kind_of_sentence(name: str) -> None:
    mod = rung(name)
    said: set[str] = set()
    for eng, actions in scenarios(mod):
        said |= explained_run(mod, eng, **actions)
    expected = set(KINDS) - (set() if name != "m13_output_caching" else set(FORCED_KINDS))
    expected -= set() if name == "m16_request_draft_lengths" else set(LIMIT_KINDS)
    assert said == expected, f"never said: {sorted(expected - said)}"
