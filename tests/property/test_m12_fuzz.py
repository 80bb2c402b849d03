"""A state-machine fuzzer for m12: requests are added, steps taken and requests aborted at random.

Rules: offer a request (valid, with stop ids and accept scripts; zero-token; empty prompt or negative
``max_new_tokens``; larger than the pool; a duplicate of a live id), take a step, abort any id (live,
finished, rejected, aborted or unknown).  The door's answer is predicted independently from the
requests' own states, and so is what each step admits (``predicted_admission``); the engine is built
with or without the shared-prefix hold (N24).  After every rule: ``check_invariants()``; free + private + cache-owned pages =
``num_pages`` with the three sets disjoint; no private page in two tables; every trie block is
cache-owned and holds the positions its key names (the cache never serves a page that is not
resident); every request is in one of the five states, and only a RUNNING one holds pages.  Every
record reports exactly the refusals and aborts made since the step before.  At teardown the engine
is stepped to quiescence (bounded): every request that entered is FINISHED, REJECTED or ABORTED, and
each one's ids are those the scripted model predicts (a prefix of them when aborted).

``test_m12_fuzz`` is the CI run (a few seconds); ``test_m12_fuzz_slow`` (``-m slow``) runs many more
and longer programs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from ladder_harness import predicted_admission

from mechserve.spec import m12_admission_control as m

R = m.Request
Why = m.RejectReason
S = m.RequestState
IDS = ("a", "b", "c", "d", "e", "f")
TOKENS = st.integers(1, 4)  # a tiny alphabet, so prompts share cached blocks
HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
CI = settings(max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=HEALTH)
SLOW = settings(max_examples=2500, stateful_step_count=80, deadline=None, suppress_health_check=HEALTH)
QUIESCENCE = 5_000
"""Steps allowed at teardown; a run needs at most a few hundred."""


def chain(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model samples after ``prompt``."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


def predicted(r: m.Request) -> tuple[list[int], m.FinishReason]:
    """The ids and finish reason rule S (with stop ids) gives ``r`` under the scripted model."""
    out: list[int] = []
    for j, token in enumerate(chain(r.tokens, r.max_new_tokens)):
        if r.eos_after is not None and j >= r.eos_after:
            return [*out, m.EOS_TOKEN_ID], m.FinishReason.EOS
        if token in r.stop_token_ids:
            return [*out, token], m.FinishReason.STOP
        out.append(token)
    return out, m.FinishReason.LENGTH


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.eng: m.Engine | None = None
        self.entered: list[m.Request] = []
        self.accepted_ids: set[str] = set()
        self.rejected: list[tuple[str, Why]] = []  # since the last step, in door order
        self.aborted: list[str] = []
        self.offered_at: dict[int, int] = {}  # id() of a request -> the step counter when it was offered

    # ---- the engine -------------------------------------------------------------------------------------

    @initialize(
        ps=st.integers(1, 4),
        pages=st.integers(1, 12),
        budget=st.integers(1, 8),
        spec_len=st.integers(0, 3),
        world_size=st.integers(1, 2),
        max_waiting=st.none() | st.integers(1, 5),
        max_running=st.none() | st.integers(1, 4),
        max_model_len=st.none() | st.integers(4, 40),
        hold=st.booleans(),
    )
    def build(
        self, ps: int, pages: int, budget: int, spec_len: int, world_size: int, hold: bool, **limits: int | None
    ) -> None:
        self.eng = m.Engine(
            [], budget, ps, pages, spec_len=spec_len, world_size=world_size, hold_shared_prefix=hold, **limits
        )

    @property
    def engine(self) -> m.Engine:
        assert self.eng is not None
        return self.eng

    def live(self) -> list[m.Request]:
        return [r for r in self.entered if r.state in (S.WAITING, S.RUNNING)]

    def door(self, r: m.Request) -> Why | None:
        """What the door must answer, from the requests' states alone."""
        eng = self.engine
        if not r.tokens:
            return Why.EMPTY_PROMPT
        if r.max_new_tokens < 0:
            return Why.BAD_MAX_NEW_TOKENS
        if any(x.request_id == r.request_id for x in self.live()):
            return Why.DUPLICATE_ID
        if eng.max_model_len is not None and r.prompt_len + r.max_new_tokens > eng.max_model_len:
            return Why.TOO_LONG
        if r.max_new_tokens > 0 and m.pages_for(r.prompt_len + r.max_new_tokens - 1, eng.pool.page_size) > (
            eng.pool.num_pages
        ):
            return Why.NEVER_FITS
        if eng.max_waiting is not None and sum(x.state is S.WAITING for x in self.entered) >= eng.max_waiting:
            return Why.OVERLOADED
        return None

    def offer(self, r: m.Request) -> None:
        self.offered_at[id(r)] = self.engine.step_counter
        want = self.door(r)
        assert self.engine.add_request(r) is want
        self.entered.append(r)
        if want is None:
            assert r.state is S.WAITING
            self.accepted_ids.add(r.request_id)
        else:
            assert (r.state, r.reject_reason) == (S.REJECTED, want)
            self.rejected.append((r.request_id, want))

    def capacity(self) -> int:
        return self.engine.pool.num_pages * self.engine.pool.page_size

    # ---- rules ------------------------------------------------------------------------------------------

    @rule(
        rid=st.sampled_from(IDS),
        data=st.data(),
        arrival=st.integers(-1, 3),
        eos_after=st.none() | st.integers(-1, 5),
        script=st.none() | st.lists(st.integers(-1, 4), max_size=4),
        stop_at=st.none() | st.integers(0, 6),
        ignore_eos=st.booleans(),
    )
    def add(
        self,
        rid: str,
        data: st.DataObject,
        arrival: int,
        eos_after: int | None,
        script: list[int] | None,
        stop_at: int | None,
        ignore_eos: bool,
    ) -> None:
        """A well-formed request that fits the pool (it may still be a duplicate, too long or overloaded)."""
        cap = self.capacity()
        prompt = data.draw(st.lists(TOKENS, min_size=1, max_size=min(16, cap)), label="prompt")
        max_new = data.draw(st.integers(1, min(12, cap - len(prompt) + 1)), label="max_new")
        stops = () if stop_at is None else (chain(prompt, 7)[stop_at],)
        step = self.engine.step_counter
        self.offer(R(rid, prompt, max_new, step + arrival, eos_after, script, stops, ignore_eos))

    add_more = add  # a second rule with the same body: valid offers twice as any other rule

    @rule(
        kind=st.sampled_from(["zero tokens", "invalid", "oversize", "duplicate"]),
        rid=st.sampled_from(IDS),
        prompt=st.lists(TOKENS, min_size=1, max_size=40),
        n=st.integers(-3, 3),
        data=st.data(),
    )
    def add_odd(self, kind: str, rid: str, prompt: list[int], n: int, data: st.DataObject) -> None:
        """Zero tokens (any prompt), an empty prompt or negative ``max_new_tokens``, a request larger
        than the pool, or a duplicate of a live id."""
        if kind == "zero tokens":
            r = R(rid, prompt, 0, self.engine.step_counter + abs(n))
        elif kind == "invalid":
            r = R(rid, [], n) if n % 2 else R(rid, prompt[:3], -1 - abs(n))
        elif kind == "oversize":
            prompt = prompt[:12]
            r = R(rid, prompt, max(1, self.capacity() - len(prompt) + 2) + abs(n))
        else:
            live = sorted({r.request_id for r in self.live()})
            r = R(data.draw(st.sampled_from(live), label="live id") if live else rid, prompt[:4], 1)
        self.offer(r)

    @precondition(lambda self: self.eng is not None and bool(self.eng.running or self.eng.waiting or self.eng.due))
    @rule(n=st.integers(1, 6))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    @rule()
    def step(self) -> None:
        eng = self.engine
        running_before = len(eng.running)
        waiting = {r.request_id: r for r in self.entered if r.state is S.WAITING}
        want = predicted_admission(eng, self.offered_at)
        rec = eng.step()
        assert rec.admitted == want
        # admission: a request arrived (and offered) before this step waits only while max_running is
        # reached, or (hold_shared_prefix, N24) while a running request computes the prefix it shares
        took_slot = sum(waiting[rid].max_new_tokens > 0 for rid in rec.admitted)
        held = [
            r
            for r in self.entered
            if r.state is S.WAITING and max(r.arrival_step, self.offered_at[id(r)]) < eng.step_counter
        ]
        if eng.hold_shared_prefix:
            assert not eng.max_running or running_before + took_slot <= eng.max_running
        elif eng.max_running is None:
            assert not held, f"{[r.request_id for r in held]} arrived but were not admitted"
        else:
            assert running_before + took_slot <= eng.max_running
            assert not held or running_before + took_slot == eng.max_running
        assert list(rec.rejected) == self.rejected
        assert rec.aborted == tuple(self.aborted)
        self.rejected, self.aborted = [], []
        for rid, why in rec.finished.items():
            assert why in (m.FinishReason.LENGTH, m.FinishReason.EOS, m.FinishReason.STOP)
            assert any(r.request_id == rid and r.state is S.FINISHED for r in self.entered)
        assert sum(rec.executed.values()) <= self.engine.max_step_tokens

    @rule(data=st.data(), pick=st.sampled_from([S.RUNNING, S.WAITING, None]))
    def abort(self, data: st.DataObject, pick: S | None) -> None:
        """Abort a running or a waiting request, or any id at all (finished, rejected, aborted, unknown)."""
        ids = sorted({r.request_id for r in self.entered if r.state is pick}) or [*IDS, "ghost"]
        rid = data.draw(st.sampled_from(ids), label="id")
        target = [r for r in self.live() if r.request_id == rid]
        before = {id(r): r.page_table[:] for r in target}
        assert self.engine.abort(rid) is bool(target)
        for r in target:
            assert (r.state, r.page_table, r.draft_len) == (S.ABORTED, [], 0)
            for page in before[id(r)]:
                assert self.engine.pool.owner[page] in (None, m.CACHE)
        if target:
            self.aborted.append(rid)

    # ---- invariants --------------------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.eng is None:
            return
        eng = self.eng
        eng.check_invariants()
        free = list(eng.pool.free)
        cached = [node.block for _, node in walk(eng.cache.root, 0)]
        private: list[int] = []
        for r in eng.requests:
            private += [p for p in r.page_table if eng.pool.owner[p] == r.request_id]
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached) == eng.cache.size
        assert len(set(private)) == len(private), "a private page is owned twice"
        assert not (set(free) & set(cached) or set(free) & set(private) or set(cached) & set(private))
        assert len(free) + len(private) + len(cached) == eng.pool.num_pages

    @invariant()
    def cache_pages_are_resident(self) -> None:
        if self.eng is None:
            return
        ps = self.eng.pool.page_size
        for depth, node in walk(self.eng.cache.root, 0):
            assert self.eng.pool.owner[node.block] is m.CACHE
            slots = self.eng.pool.slots[node.block]
            assert [slot and slot[1] for slot in slots] == [depth * ps + o for o in range(ps)]

    @invariant()
    def states_are_consistent(self) -> None:
        if self.eng is None:
            return
        assert [id(r) for r in self.eng.requests] == [id(r) for r in self.entered]
        for r in self.entered:
            assert r.state in (S.WAITING, S.RUNNING, S.FINISHED, S.REJECTED, S.ABORTED)
            if r.state is not S.RUNNING:
                assert r.page_table == [], f"{r.request_id} is {r.state.value} but holds pages"
            assert (r.reject_reason is not None) == (r.state is S.REJECTED)
            assert (r.finish_reason is not None) == (r.state is S.FINISHED)
            assert r.generated <= max(0, r.max_new_tokens)
        assert set(self.eng.live) == {r.request_id for r in self.live()}

    def teardown(self) -> None:
        if self.eng is None:
            return
        eng = self.eng
        for _ in range(QUIESCENCE):
            if not (eng.waiting or eng.due or eng.running):
                break
            eng.step()
            eng.check_invariants()
        else:
            raise AssertionError(f"not quiescent after {QUIESCENCE} steps")
        for r in self.entered:
            assert r.state in (S.FINISHED, S.REJECTED, S.ABORTED), f"{r.request_id} is {r.state.value}"
            if r.state is S.REJECTED:
                assert not r.output_ids
                continue
            # every accepted request, a reused id included, gets exactly the scripted model's ids
            ids, reason = predicted(r)
            if r.state is S.FINISHED:
                assert (r.output_ids, r.finish_reason) == (ids, reason), r.request_id
                ended = reason in (m.FinishReason.EOS, m.FinishReason.STOP)
                assert r.generated == len(ids) - ended, "a final EOS or stop id is not counted"
            else:
                assert r.output_ids == ids[: len(r.output_ids)], r.request_id
                assert r.generated == len(r.output_ids)
        assert all(owner is None or owner is m.CACHE for owner in eng.pool.owner)


def walk(children: dict[m.PrefixKey, m.RadixNode], depth: int) -> Iterator[tuple[int, m.RadixNode]]:
    """Every trie node with its depth (block index), depth first."""
    for node in children.values():
        yield depth, node
        yield from walk(node.children, depth + 1)


def test_m12_fuzz() -> None:
    run_state_machine_as_test(AdmissionMachine, settings=CI)


@pytest.mark.slow
def test_m12_fuzz_slow() -> None:
    run_state_machine_as_test(AdmissionMachine, settings=SLOW)
