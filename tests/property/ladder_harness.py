"""Run a workload on one rung with every per-step check switched on, and compare traces across rungs.

``execute(rung, workload)`` builds the rung's engine (``strategies.build``), runs it through
``Engine.run(on_step=...)`` and, after every step, checks what must hold on every rung where it
applies (``check_step``, ``check_frontiers``): the token budget, page conservation and
``check_invariants()``, the request bounds, the work list against the rung's scheduling rule, how every
frontier moved, the victims' order (always RUNNING requests), D2's own-chain invariant, the trace's
internal shape, that every arrived request is admitted unless m12's ``max_running`` is reached and, from
m12 on, in arrival order (``check_admitted``), and on m12 the door's bookkeeping (``check_admission``: REJECTED and ABORTED
requests hold no page and appear in no work field, each record's ``rejected``/``aborted`` names
requests in that state, zero-token requests finish at admission).  A check failure or a run past a generous step bound raises ``AssertionError``; an
engine exception is captured in ``Run.error`` so the property can decide whether it is the
documented one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, settings

from mechserve.conformance.strategies import build, cli_valid, engine_of, prompt_len
from mechserve.spec import RUNGS

MODULES: dict[str, ModuleType] = {name: importlib.import_module(f"mechserve.spec.{name}") for name in RUNGS}
INDEX = {name: i for i, name in enumerate(RUNGS)}

CONTRACT = (
    "step",
    "admitted",
    "scheduled",
    "executed",
    "sampled",
    "finished",
    "preempted",
    "reused",
    "published",
    "evicted",
    "drafted",
    "accepted",
    "rolled_back",
)
"""The 13 trace fields in contract order (MECHANISMS 4.3)."""

ADMISSION_FIELDS = ("rejected", "aborted")
"""m12's two trace fields, written after ``tokens`` (N15)."""

LIVE = ("WAITING", "RUNNING")
GONE = ("FINISHED", "REJECTED", "ABORTED")
"""Request states: live ones may hold pages (RUNNING only, in fact); the three end states hold none."""

CI = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Settings for the default (CI) run: the whole property suite stays well under a minute on 2 cores."""

SLOW = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Settings for the ``slow`` variants."""


def rung_index(rung: str) -> int:
    return INDEX[rung]


def fields_of(rung: str) -> tuple[str, ...]:
    """The JSON keys of the rung's records, in order: its share of the 13, plus ``tokens`` from m10,
    plus ``rejected`` and ``aborted`` from m12."""
    i = INDEX[rung]
    n = 6 if i < 5 else 7 if i < 8 else 10 if i < 9 else 13
    return CONTRACT[:n] + (("tokens",) if i >= 10 else ()) + (ADMISSION_FIELDS if i >= 12 else ())


def has_door(rung: str) -> bool:
    """m12+: requests pass a door, so a request that can never be served is REJECTED, not raised."""
    return INDEX[rung] >= 12


def step_bound(workload: dict[str, Any]) -> int:
    """A generous bound on the steps of any terminating run.

    After the last arrival the first RUNNING request the scheduler walks (the anchor: in list order below
    m12, in admission order from m12 on, D9) is never preempted and computes at least one position per
    step, so it finishes within ``prompt + max_new`` steps.
    """
    reqs = workload.get("requests") or []
    last = max((max(0, int(r.get("arrival_step") or 0)) for r in reqs), default=0)
    return 2 * (last + sum(prompt_len(r) + int(r["max_new_tokens"]) for r in reqs)) + 10


class StepBoundExceeded(AssertionError):
    """The run went on past ``step_bound``: a livelock."""


@dataclass
class Run:
    """One run: the records produced (also those before an error), the error, the engine after it."""

    rung: str
    workload: dict[str, Any]
    engine: Any
    records: list[Any] = field(default_factory=list)
    error: Exception | None = None

    @property
    def trace(self) -> list[dict[str, Any]]:
        return [rec.to_json() for rec in self.records]

    @property
    def error_name(self) -> str | None:
        return None if self.error is None else type(self.error).__name__

    def project(self, names: tuple[str, ...]) -> list[dict[str, Any]]:
        """The trace restricted to ``names``."""
        return [{k: rec[k] for k in names} for rec in self.trace]

    def outcome(self, names: tuple[str, ...] | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """``(trace projected on names, error type name)``: what two runs must agree on."""
        return self.project(names or fields_of(self.rung)), self.error_name


def execute(rung: str, workload: dict[str, Any], *, check: bool = True) -> Run:
    """Run ``workload`` on ``rung`` with the per-step checks (``check``) and the step bound.

    A valid workload goes through the CLI's loader (``mechserve.workload``); one with negative
    ``arrival_step``/``eos_after`` (legal for the engines, rejected by D4) is built directly.
    """
    module = MODULES[rung]
    engine = build(module, workload, validate=cli_valid(workload))
    run = Run(rung, workload, engine)
    bound = step_bound(workload)
    before = snapshot(engine)
    admitted: list[str] = []  # every id the records admitted so far, in admission order (m12+, D9)

    def on_step(record: Any) -> None:
        nonlocal before
        run.records.append(record)
        admitted.extend(record.admitted)
        if check:
            order = walk_order(rung, engine, admitted)
            check_step(rung, engine, record, len(run.records) - 1, order)
            check_frontiers(rung, engine, record, before, order)
            before = snapshot(engine)
        if len(run.records) > bound:
            raise StepBoundExceeded(f"{rung}: still running after {bound} steps")

    try:
        engine.run(on_step=on_step)
    except AssertionError:
        raise
    except Exception as exc:  # the engine's own error; the property decides whether it is documented
        run.error = exc
    return run


# ---- per-step checks -------------------------------------------------------------------------------------


def _in_order(sub: list[str], seq: list[str]) -> bool:
    it = iter(seq)
    return all(x in it for x in sub)


def cache_blocks(engine: Any) -> list[int]:
    """Every page the radix cache holds (m08+; empty below)."""
    cache = getattr(engine, "cache", None)
    if cache is None:
        return []
    blocks: list[int] = []
    stack = [cache.root]
    while stack:
        for node in stack.pop().values():
            blocks.append(node.block)
            stack.append(node.children)
    return blocks


def check_pages(engine: Any) -> None:
    """Page conservation, computed independently of ``check_invariants``.

    free + request-owned + cache-owned == num_pages; no page is in two of those sets, on the free list
    twice, cached twice, or privately held by two page tables; a private page is in its owner's table.
    """
    pool = engine.pool
    free = list(pool.free)
    private = {p: o for p, o in enumerate(pool.owner) if isinstance(o, str)}
    cached = cache_blocks(engine)
    assert len(free) == len(set(free)), f"free list repeats a page: {free}"
    assert len(cached) == len(set(cached)), f"a page is cached twice: {cached}"
    assert not set(free) & set(private), "a free page has an owner"
    assert not set(free) & set(cached), "a cached page is on the free list"
    assert not set(private) & set(cached), "a cached page has a request owner"
    assert len(free) + len(private) + len(cached) == pool.num_pages, (
        f"pages not conserved: {len(free)} free + {len(private)} private + {len(cached)} cached != {pool.num_pages}"
    )
    holders: dict[int, str] = {}
    for r in engine.requests:
        for page in r.page_table:
            if page in private:
                assert private[page] == r.request_id, f"{r.request_id} holds page {page} owned by {private[page]}"
                assert page not in holders, f"page {page} privately held twice"
                holders[page] = r.request_id
            else:
                assert page in cached, f"{r.request_id} holds page {page}, neither its own nor cached"
    assert set(holders) == set(private), "a request-owned page is in no page table"


def walk_order(rung: str, engine: Any, admitted: list[str]) -> list[Any]:
    """The order in which the rung's scheduler walks requests (reuse, draft, schedule; victims from its end).

    Below m12, list order (``engine.requests``).  From m12 on (D9, first come, first served) admission
    order: the ids of ``admitted``, every record's ``admitted`` field so far concatenated in step order,
    each mapped to its (not rejected) request; a preempted request keeps its place.  ``execute`` offers
    every request in the constructor, so the ids of the requests that were not rejected are unique.
    """
    if INDEX[rung] < 12:
        return list(engine.requests)
    by_id = {r.request_id: r for r in engine.requests if r.state.value != "REJECTED"}
    return [by_id[rid] for rid in admitted]


def check_step(rung: str, engine: Any, record: Any, index: int, order: list[Any] | None = None) -> None:
    """Everything that must hold after every step of ``rung``; ``order`` is ``walk_order`` (list order
    when omitted, right below m12 only)."""
    order = list(engine.requests) if order is None else order
    i = INDEX[rung]
    rec = record.to_json()
    assert rec["step"] == index
    executed, scheduled = list(rec["executed"]), rec["scheduled"]
    assert all(v >= 1 for v in rec["executed"].values()), rec["executed"]
    assert _in_order(executed, scheduled), (executed, scheduled)
    assert _in_order(list(rec["sampled"]), executed)
    by_id = {r.request_id: r for r in engine.requests if r.state.value not in ("REJECTED", "ABORTED")}
    # Only a zero-token request (m12, N10) finishes without sampling: at admission, in list order.
    unsampled = [rid for rid in rec["finished"] if rid not in rec["sampled"]]
    assert _in_order([rid for rid in rec["finished"] if rid in rec["sampled"]], list(rec["sampled"]))
    assert _in_order(unsampled, rec["admitted"]), (unsampled, rec)
    for rid in unsampled:
        r = by_id[rid]
        assert i >= 12 and r.max_new_tokens == 0 and rec["finished"][rid] == "LENGTH", (rid, rec)
        assert (r.generated, r.computed, r.output_ids, r.page_table) == (0, 0, [], []), rid
    assert all(by_id[rid].state.value == "FINISHED" for rid in rec["finished"])
    if i >= 2:  # m02: the token budget
        assert sum(rec["executed"].values()) <= engine.max_step_tokens, (rec["executed"], engine.max_step_tokens)
    if i >= 3:  # m03: pages
        engine.check_invariants()
        check_pages(engine)
    # The post-preemption work is the scheduled work less the victims, in work order.
    assert executed == [rid for rid in scheduled if rid not in rec.get("preempted", ())], (executed, rec)
    if i >= 5:  # m05: victims come from the end of the walk (the list; m12+: admission order), once each,
        # never the anchor
        ids = [r.request_id for r in order]
        victims = [ids.index(rid) for rid in rec["preempted"]]
        assert victims == sorted(set(victims), reverse=True), rec["preempted"]
        # A victim keeps its history and stays RUNNING: never a rejected, aborted or finished request.
        assert all(by_id[rid].state.value == "RUNNING" for rid in rec["preempted"]), rec["preempted"]
        assert not scheduled or scheduled[0] not in rec["preempted"], rec
        for r in order[victims[0] + 1 :] if victims else ():
            if r.state.value == "RUNNING":  # it was passed over, so it held nothing and had no work
                assert r.request_id not in rec["executed"] and not r.page_table, (r.request_id, rec)
    if i >= 8:  # m08
        ps = engine.pool.page_size
        assert all(v > 0 and v % ps == 0 for v in rec["reused"].values()), rec["reused"]
        assert all(v > 0 for v in rec["published"].values()), rec["published"]
        assert len(set(rec["evicted"])) == len(rec["evicted"])
        assert _in_order(list(rec["published"]), executed)
        for rid, blocks in rec["published"].items():
            if output_caching(engine):  # m13: complete computed blocks of prompt + output
                assert blocks <= by_id[rid].computed // ps, "a block past the computed frontier was published"
            else:
                assert blocks <= by_id[rid].prompt_len // ps, "a block holding generated tokens was published"
        check_own_chain(engine)
        check_cached_slots(engine)
    if i >= 9:  # m09: one entry per decode window, in all three dicts
        assert list(rec["drafted"]) == list(rec["accepted"]) == list(rec["rolled_back"])
        assert _in_order(list(rec["drafted"]), executed)
        for rid, d in rec["drafted"].items():
            a, b = rec["accepted"][rid], rec["rolled_back"][rid]
            assert d == rec["executed"][rid] - 1 and d <= engine.spec_len, (rid, rec)
            assert 0 <= a <= d and d == a + b, (rid, d, a, b)
    if i >= 10:  # m10: ids travel back for every sampling request
        assert list(rec["tokens"]) == list(rec["sampled"])
        for rid, ids in rec["tokens"].items():
            assert len(ids) == rec["accepted"].get(rid, 0) + 1
            assert (ids[-1] == MODULES[rung].EOS_TOKEN_ID) == (rec["sampled"][rid] == "EOS")
    if i >= 12:
        check_admission(engine, rec)
    for r in engine.requests:
        draft = getattr(r, "draft_len", 0)
        assert 0 <= r.computed <= r.target + draft, (r.request_id, r.computed, r.target, draft)
        assert 0 <= r.generated <= r.max_new_tokens, (r.request_id, r.generated, r.max_new_tokens)
        assert (r.state.value == "FINISHED") == (r.finish_reason is not None)
        if i >= 3 and r.state.value in GONE:
            assert not r.page_table, f"{r.request_id} is {r.state.value} but holds pages {r.page_table}"


def check_admission(engine: Any, rec: dict[str, Any]) -> None:
    """m12 after every step: the door's and abort's bookkeeping (N7, N8, N13, N14).

    A REJECTED request has its reason and nothing else (no page, no computed position, no sample, no
    running place); an ABORTED one holds no page and no running place; both are out of the live set.
    ``rejected`` names REJECTED requests with their reasons; an id that only rejected requests carry
    appears in no other field, and an aborted id in no other field of that record.  Only RUNNING
    requests hold pages.
    """
    states = {r.request_id: set() for r in engine.requests}
    for r in engine.requests:
        states[r.request_id].add(r.state.value)
        assert (r.state.value == "REJECTED") == (r.reject_reason is not None), (r.request_id, r.state)
        if r.state.value != "RUNNING":
            assert not r.page_table, f"{r.request_id} is {r.state.value} but holds pages {r.page_table}"
            assert all(x is not r for x in engine.running), f"{r.request_id} is {r.state.value} but running"
        if r.state.value in ("REJECTED", "ABORTED"):
            assert engine.live.get(r.request_id) is not r, f"{r.request_id} is {r.state.value} but live"
            assert r.draft_len == 0, r.request_id
        if r.state.value == "REJECTED":
            assert (r.computed, r.generated, r.output_ids) == (0, 0, []), r.request_id
    live = {r.request_id for r in engine.requests if r.state.value in LIVE}
    assert set(engine.live) == live and all(engine.live[rid].state.value in LIVE for rid in live)
    work_fields = [k for k in rec if k not in ("step", "rejected", "aborted", "evicted")]
    mentioned = {rid for k in work_fields for rid in rec[k]}
    for rid, reason in rec["rejected"]:
        assert any(
            r.request_id == rid and r.state.value == "REJECTED" and r.reject_reason.value == reason
            for r in engine.requests
        ), (rid, reason)
        if states[rid] == {"REJECTED"}:
            assert rid not in mentioned, f"rejected {rid} appears in the work of step {rec['step']}"
    for rid in rec["aborted"]:
        assert "ABORTED" in states[rid] and rid not in mentioned, (rid, rec)


def check_cached_slots(engine: Any) -> None:
    """Every cached block holds what its key names (m08+; m13's generated blocks too): slot ``o`` of the
    block at depth ``d`` holds position ``d * page_size + o``, written by a request whose tokens (prompt,
    then output ids) up to that position are the tokens the key chain spells."""
    ps = engine.pool.page_size
    history = {id(r): [*r.tokens, *getattr(r, "output_ids", ())] for r in engine.requests}
    writers: dict[str, list[list[int]]] = {}
    for r in engine.requests:
        writers.setdefault(r.request_id, []).append(history[id(r)])
    stack: list[tuple[tuple[int, ...], Any]] = [((), engine.cache.root)]
    while stack:
        spelled, children = stack.pop()
        for key, node in children.items():
            tokens = spelled + tuple(key.block_tokens)
            for offset, slot in enumerate(engine.pool.slots[node.block]):
                assert slot is not None, f"cached page {node.block}: offset {offset} never written"
                writer, pos = slot
                assert pos == len(tokens) - ps + offset, (node.block, slot)
                want = list(tokens[: pos + 1])
                assert any(h[: pos + 1] == want for h in writers.get(writer, [])), (
                    f"cached page {node.block}: {writer} wrote position {pos} over other tokens than its key's"
                )
            stack.append((tokens, node.children))


def output_caching(engine: Any) -> bool:
    """m13 with output caching on (and prefix caching): generated blocks are published too."""
    return bool(getattr(engine, "output_caching", False)) and engine.prefix_caching


def check_own_chain(engine: Any) -> None:
    """D2: a live request's cached pages lead its page table and are its own chain in the trie (its
    prompt's, or with m13's output caching its whole sequence's)."""
    cached = set(cache_blocks(engine))
    for r in engine.requests:
        if r.state.value in GONE:
            continue
        shared = [p for p in r.page_table if p in cached]
        keys = r.block_keys if output_caching(engine) else r.prompt_keys
        assert r.page_table[: len(shared)] == shared, f"{r.request_id}: a cached page after a private one"
        assert engine.cache.match(keys)[: len(shared)] == shared, f"{r.request_id}: not its own chain"


def snapshot(engine: Any) -> dict[str, tuple[int, int, str]]:
    """``request_id -> (computed, generated, state)`` between steps."""
    return {r.request_id: (r.computed, r.generated, r.state.value) for r in engine.requests}


def expected_work(
    rung: str, engine: Any, rec: dict[str, Any], before: dict[str, tuple[int, int, str]], order: list[Any]
) -> list:
    """The work list the rung's scheduler must build, ``[(request_id, n)]``, from the state before the step,
    walking the requests in ``order`` (``walk_order``: list order, from m12 on admission order, D9).

    m00/m01: every RUNNING request, whole.  m02/m03: whole requests that fit what is left of the
    budget, skipping those that do not.  m04+: ``min(remaining, left)`` each, stopping at 0.  The
    frontier is taken after reuse (m08); ``remaining`` includes the draft (m09, D1).
    """
    i = INDEX[rung]
    k = getattr(engine, "spec_len", 0)
    budget = getattr(engine, "max_step_tokens", None)
    work = []
    for r in order:
        computed, generated, state = before[r.request_id]
        if state != "RUNNING" and (r.request_id not in rec["admitted"] or state != "WAITING"):
            continue
        if r.max_new_tokens == 0:  # m12 (N10): finished at admission, nothing to compute
            continue
        start = rec.get("reused", {}).get(r.request_id, computed)
        target = r.prompt_len + generated
        draft = min(k, r.max_new_tokens - generated - 1) if generated >= 1 and start == target - 1 else 0
        remaining = target - start + draft
        if i < 2:
            work.append((r.request_id, remaining))
        elif i < 4:
            if remaining <= budget:
                work.append((r.request_id, remaining))
                budget -= remaining
        elif budget > 0:
            work.append((r.request_id, min(remaining, budget)))
            budget -= min(remaining, budget)
    return work


def check_frontiers(
    rung: str, engine: Any, record: Any, before: dict[str, tuple[int, int, str]], order: list[Any] | None = None
) -> None:
    """The step scheduled exactly what the rung's scheduler rule gives (walking ``order``, ``walk_order``;
    list order when omitted, right below m12 only), and moved every frontier as recorded.

    ``scheduled`` and every executed ``n`` match ``expected_work``; an executed request keeps what
    resolve did not roll back and is ready (samples) exactly when it reached its target; a victim is
    back at 0; nobody else moves but by reuse, which only a cold request gets and never up to its target
    (D7); ``generated`` grows by the accepted guesses plus one per TOKEN.
    """
    rec = record.to_json()
    reused, rolled, accepted = rec.get("reused", {}), rec.get("rolled_back", {}), rec.get("accepted", {})
    work = expected_work(rung, engine, rec, before, list(engine.requests) if order is None else order)
    assert rec["scheduled"] == [rid for rid, _ in work], (rec["scheduled"], work)
    assert rec["executed"] == {rid: n for rid, n in work if rid in rec["executed"]}, (rec["executed"], work)
    for r in engine.requests:
        rid = r.request_id
        computed, generated, _ = before[rid]
        start = reused.get(rid, computed)
        if rid in reused:
            ps = engine.pool.page_size
            # m13 N8: the whole known sequence; else the complete prompt blocks.  D7: at most (target - 1) // ps
            # blocks, so a position is always computed (a preempted request reuses its whole cached prompt).
            blocks = (r.prompt_len + generated) // ps if output_caching(engine) else r.prompt_len // ps
            cap = min(blocks, (r.prompt_len + generated - 1) // ps)
            assert computed == 0 and reused[rid] <= cap * ps, (rid, computed, reused)
        target = r.prompt_len + generated
        acc = accepted.get(rid, 0)
        assert r.generated == generated + acc + (rec["sampled"].get(rid) == "TOKEN"), (rid, rec)
        if rid in rec.get("preempted", ()):
            assert r.computed == 0, (rid, r.computed)
        elif rid in rec["executed"]:
            end = start + rec["executed"][rid] - rolled.get(rid, 0)
            assert r.computed == end, (rid, r.computed, end)
            assert (rid in rec["sampled"]) == (end == target + acc), (rid, end, target, acc, rec)
        else:
            assert r.computed == start, (rid, r.computed, start)
    check_admitted(engine, rec, before, INDEX[rung] >= 12)


def check_admitted(
    engine: Any, rec: dict[str, Any], before: dict[str, tuple[int, int, str]], fcfs: bool = False
) -> None:
    """Every request that has arrived by this step is admitted at it, unless m12's ``max_running`` is
    reached (N9): then the RUNNING requests and the ones this step admitted (a zero-token request takes
    no slot, N10) fill it exactly, and never more.

    With ``fcfs`` (m12+, D9) the step admits the due requests in arrival order: those WAITING before the
    step with ``max(0, arrival_step) <= step`` (every request was offered before step 0), ordered by
    that step and then list order; it admits the first of them (max_running stops the walk), or, with
    ``hold_shared_prefix``, some of them in that order.
    """
    if fcfs:
        due = [
            r
            for r in engine.requests
            if r.state.value != "REJECTED"
            and before[r.request_id][2] == "WAITING"
            and max(0, r.arrival_step) <= rec["step"]
        ]
        due_ids = [r.request_id for r in sorted(due, key=lambda r: max(0, r.arrival_step))]  # stable: list order
        if getattr(engine, "hold_shared_prefix", False):
            assert _in_order(rec["admitted"], due_ids), (rec["admitted"], due_ids)
        else:
            assert rec["admitted"] == due_ids[: len(rec["admitted"])], (rec["admitted"], due_ids)
    limit = getattr(engine, "max_running", None)
    held = [r.request_id for r in engine.requests if r.state.value == "WAITING" and r.arrival_step <= rec["step"]]
    if limit is None:
        assert not held, f"{held} arrived by step {rec['step']} but were not admitted"
        return
    by_id = {r.request_id: r for r in engine.requests if r.state.value not in ("REJECTED", "ABORTED")}
    running = sum(state == "RUNNING" for _, _, state in before.values())
    took = sum(by_id[rid].max_new_tokens > 0 for rid in rec["admitted"])
    assert running + took <= limit, (running, took, limit, rec["admitted"])
    assert not held or running + took == limit, (held, running, took, limit)


def predicted_admission(engine: Any, offered_at: Mapping[int, int] | None = None) -> tuple[str, ...]:
    """What m12's next step admits, predicted before it runs from the requests' tokens alone (N9, N10,
    N24): arrived WAITING requests in arrival order (D9) while ``max_running`` allows, skipping one that
    is held.

    A request arrives at the first step that is at least its ``arrival_step`` and at least the step
    counter when it was offered (``offered_at``: ``id(request)`` -> counter; 0, before any step, when
    absent), so a negative ``arrival_step`` counts as 0; requests arriving at the same step are in
    list order.

    A request R is held when ``hold_shared_prefix`` and prefix caching are on, it wants a token, and a
    RUNNING request P (or one admitted earlier in this walk, which has computed nothing) shares ``s``
    leading complete prompt blocks with it, ``s`` capped at ``⌊(len(R) − 1)/page_size⌋``, more than
    the cache holds for R (same cap), with ``P.computed < s × page_size``.  Token blocks are compared
    directly, not through prefix keys.
    """
    ps = engine.pool.page_size
    hold = getattr(engine, "hold_shared_prefix", False) and engine.prefix_caching
    limit = getattr(engine, "max_running", None)
    running = [(r.tokens, r.computed) for r in engine.requests if r.state.value == "RUNNING"]
    admitted: list[str] = []
    offered = offered_at or {}

    def arrival(r: Any) -> int:
        return max(r.arrival_step, offered.get(id(r), 0), 0)

    waiting = [r for r in engine.requests if r.state.value == "WAITING" and arrival(r) <= engine.step_counter]
    for r in sorted(waiting, key=arrival):  # stable: list order within a step
        if limit is not None and len(running) >= limit:
            break
        if hold and r.max_new_tokens > 0:
            usable = (len(r.tokens) - 1) // ps
            cached = min(len(engine.cache.match(r.prompt_keys)), usable)

            def shared(tokens: list[int], r: Any = r, usable: int = usable) -> int:
                n = 0
                while n < min(len(tokens), len(r.tokens)) and tokens[n] == r.tokens[n]:
                    n += 1
                return min(n // ps, usable)

            if any(shared(t) > cached and c < shared(t) * ps for t, c in running):
                continue
        admitted.append(r.request_id)
        if r.max_new_tokens > 0:
            running.append((r.tokens, 0))
    return tuple(admitted)


def check_summary(run: Run) -> None:
    """A finished request's end state follows rule S (MECHANISMS 1.5), with m12's stop ids (N17) and
    zero-token requests (N10)."""
    for r, spec in zip(run.engine.requests, run.workload.get("requests") or []):
        if r.state.value != "FINISHED":
            continue
        eos = spec.get("eos_after")
        stops = spec.get("stop_token_ids") or ()
        out = getattr(r, "output_ids", [])  # m10+
        if r.max_new_tokens == 0:
            assert (r.finish_reason.value, r.generated, r.computed, r.page_table) == ("LENGTH", 0, 0, [])
        elif r.finish_reason.value == "LENGTH":
            assert r.generated == r.max_new_tokens
            assert eos is None or eos >= r.max_new_tokens
            assert r.computed == prompt_len(spec) + r.generated - 1
            assert not set(out) & set(stops), "a stop id was sampled but did not stop it"
        elif r.finish_reason.value == "EOS":
            assert eos is not None and r.generated == max(0, eos) < r.max_new_tokens
            assert r.computed == prompt_len(spec) + r.generated
            assert not set(out[:-1]) & set(stops), "a stop id was sampled but did not stop it"
        else:
            assert r.finish_reason.value == "STOP" and out[-1] in stops, (r.request_id, out)
            assert eos is None or r.generated < eos, "eos_after is checked before the stop ids (N17)"
            assert r.generated == len(out) - 1 < r.max_new_tokens
            assert not set(out[:-1]) & set(stops), "a stop id before the one that ended it"
            assert r.computed == prompt_len(spec) + r.generated


def anchor_of(engine: Any) -> Any:
    """The first RUNNING request in list order: the anchor of the step that failed."""
    return next(r for r in engine.requests if r.state.value == "RUNNING")


def num_pages(workload: dict[str, Any]) -> int:
    return engine_of(workload)["num_pages"]
