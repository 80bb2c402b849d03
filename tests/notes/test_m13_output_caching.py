"""Pins every numbered line of mech-notes/13-output-caching.md.

The scripted model's ids are a function of a request's own history: after the prompt ``p`` the
``j``-th sampled id is ``scripted_token(previous id, len(p) + j)``, chained from ``p[-1]``
(``chain`` below), so a request's answer is known before it runs and a next turn's prompt can be
written down in advance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m12_admission_control as m12
from mechserve.spec import m13_output_caching as m

R = m.Request
FINISHED = m.RequestState.FINISHED
CI = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = [1, 2, 3, 4, 5, 6]


def run(eng: m.Engine, limit: int = 400, on_step: Callable[[m.StepRecord], None] | None = None) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops; ``on_step`` sees each record."""

    def watch(rec: m.StepRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        if on_step is not None:
            on_step(rec)

    return eng.run(on_step=watch)


def chain(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model samples after ``prompt``."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


def walk(children: dict, tokens: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], int]]:
    """``(tokens through the block, page)`` for every node of a radix cache, depth first."""
    for key, node in children.items():
        spelled = tokens + key.block_tokens
        yield spelled, node.block
        yield from walk(node.children, spelled)


def cached_sequences(eng: m.Engine) -> list[tuple[int, ...]]:
    return sorted(tokens for tokens, _ in walk(eng.cache.root))


def by_id(eng: m.Engine, rid: str) -> m.Request:
    return next(r for r in eng.requests if r.request_id == rid)


def check_cache(eng: m.Engine) -> None:
    """Page conservation, D2's own chain over the whole sequence, and every cached block's slots holding,
    position by position, the positions its key names, written by a request whose tokens are the key's."""
    eng.check_invariants()
    owners = eng.pool.owner
    assert owners.count(None) + sum(isinstance(o, str) for o in owners) + owners.count(m.CACHE) == eng.pool.num_pages
    ps = eng.pool.page_size
    history = {r.request_id: [*r.tokens, *r.output_ids] for r in eng.requests}
    for tokens, page in walk(eng.cache.root):
        assert owners[page] is m.CACHE
        start = len(tokens) - ps
        for offset, slot in enumerate(eng.pool.slots[page]):
            assert slot is not None, f"page {page} offset {offset} was never written"
            writer, pos = slot
            assert pos == start + offset
            assert history[writer][: pos + 1] == list(tokens[: pos + 1]), f"page {page}: {writer}'s tokens differ"
    for r in eng.running:
        shared = [p for p in r.page_table if owners[p] is m.CACHE]
        assert r.page_table[: len(shared)] == shared
        assert eng.cache.match(r.block_keys)[: len(shared)] == shared, f"{r.request_id}: not its own chain"


def test_m13_n1_off_the_engine_is_m12() -> None:
    assert m.Engine([], 1, 1, 1).output_caching is False
    for kwargs in ({}, {"output_caching": False}, {"output_caching": True, "prefix_caching": False}):
        prefix = kwargs.get("prefix_caching", True)
        new = m.Engine([R("a", PROMPT, 7), R("b", PROMPT + chain(PROMPT, 5), 3)], 16, 4, 8, **kwargs)
        old = m12.Engine(
            [m12.Request("a", PROMPT, 7), m12.Request("b", PROMPT + chain(PROMPT, 5), 3)],
            16,
            4,
            8,
            prefix_caching=prefix,
        )
        assert [t.to_json() for t in run(new)] == [t.to_json() for t in run(old)]
        assert new.summary() == old.summary()
    # the shared-prefix hold's own switch off and on, speculation, errors: see the property below


@CI
@given(
    w=st.one_of(
        workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
        workloads(admission=True, prompts="mixed", spec_len=(0, 2), scripts=True),
        workloads(pool="any", prompts="mixed"),
    ),
    hold=st.booleans(),
)
def test_m13_n1_off_every_field_summary_and_error_are_m12s(w: dict, hold: bool) -> None:
    def outcome(module: Any) -> tuple[list[dict], list[dict], str | None]:
        eng = build(module, w, validate=False)
        eng.hold_shared_prefix = hold
        records: list[dict] = []
        try:
            run(eng, on_step=lambda rec: records.append(rec.to_json()))
        except Exception as exc:  # compared, not raised: both rungs must fail alike
            return records, eng.summary(), type(exc).__name__
        return records, eng.summary(), None

    assert outcome(m) == outcome(m12)


def test_m13_n2_a_block_is_published_in_the_step_its_last_position_is_computed() -> None:
    eng = m.Engine([R("a", PROMPT, 7)], 16, 4, 8, output_caching=True)
    recs = run(eng, on_step=lambda rec: check_cache(eng))
    a = by_id(eng, "a")
    # prompt 0..5 at step 0; position 6 + j is computed at step 1 + j: block 1 (4..7) fills at step 2,
    # block 2 (8..11) at step 6; the last id (position 12) is never computed
    assert [dict(t.executed) for t in recs] == [{"a": 6}] + [{"a": 1}] * 6
    assert [dict(t.published) for t in recs] == [{"a": 1}, {}, {"a": 1}, {}, {}, {}, {"a": 1}]
    assert cached_sequences(eng) == [
        tuple(PROMPT[:4]),
        tuple(PROMPT + a.output_ids[:2]),
        tuple(PROMPT + a.output_ids[:6]),
    ]
    assert (a.computed, len(a.output_ids), eng.cache.size) == (12, 7, 3)
    # m12 published the prompt block only, and freed the generated pages at the finish
    old = m12.Engine([m12.Request("a", PROMPT, 7)], 16, 4, 8)
    assert [dict(t.published) for t in run(old)] == [{"a": 1}] + [{}] * 6
    assert old.cache.size == 1 and old.pool.owner.count(m12.CACHE) == 1


def test_m13_n3_keys_chain_over_prompt_then_output_and_a_next_turn_reuses_them() -> None:
    eng = m.Engine([R("a", PROMPT, 7)], 16, 4, 8, output_caching=True)
    run(eng)
    a = by_id(eng, "a")
    answer = a.output_ids
    assert a.block_keys[:1] == a.prompt_keys and len(a.prompt_keys) == 1
    straddle = a.block_keys[1]
    assert (straddle.parent, straddle.block_tokens) == (a.prompt_keys[0], (5, 6, answer[0], answer[1]))
    assert a.block_keys == m.prefix_keys([*PROMPT, *answer], 4)[:3]  # equal sequences give equal chains
    # turn 2: the prompt, the answer, a new message; m08's reuse finds the answer's blocks
    turn2 = R("b", [*PROMPT, *answer, 9, 9, 9], 2)
    assert eng.add_request(turn2) is None
    recs = run(eng)
    assert dict(recs[0].reused) == {"b": 12} and recs[0].executed["b"] == len(turn2.tokens) - 12
    assert turn2.output_ids == chain(turn2.tokens, 2)
    # the reuse cap is m08's: a prompt that is exactly prompt + 6 answer ids (3 blocks) reuses 2 of them
    exact = R("c", [*PROMPT, *answer[:6]], 1)
    eng.add_request(exact)
    assert dict(run(eng)[0].reused) == {"c": 8}


def test_m13_n4_only_final_tokens_rolled_back_guesses_never() -> None:
    # prompt 1 2 3, pages of 4, 3 guesses per window.  Step 1's window (positions 3..6) keeps 1 (script 0):
    # block 0 fills with the first sampled id.  Step 2's window (positions 4..7) writes all of block 1 but
    # keeps only position 4 (script 0): block 1 is not published.
    rolled = m.Engine([R("a", [1, 2, 3], 6, accept_script=[0, 0])], 16, 4, 8, spec_len=3, output_caching=True)
    recs = run(rolled, on_step=lambda rec: check_cache(rolled))
    assert [(t.executed["a"], t.rolled_back.get("a")) for t in recs[:3]] == [(3, None), (4, 3), (4, 3)]
    assert [dict(t.published) for t in recs[:3]] == [{}, {"a": 1}, {}]
    # accepted instead: step 1's guesses at 4..6 are final, and block 1 is published when step 2 computes 7
    kept = m.Engine([R("a", [1, 2, 3], 6)], 16, 4, 8, spec_len=3, output_caching=True)
    recs = run(kept, on_step=lambda rec: check_cache(kept))
    assert [(t.executed["a"], t.accepted.get("a")) for t in recs[:3]] == [(3, None), (4, 3), (1, 0)]
    assert [dict(t.published) for t in recs[:3]] == [{}, {"a": 1}, {"a": 1}]
    assert by_id(kept, "a").output_ids == by_id(rolled, "a").output_ids == chain([1, 2, 3], 6)

    # the id sampled last is never in a block published in the step that sampled it
    def last_id_outside_the_cache(eng: m.Engine) -> Callable[[m.StepRecord], None]:
        def check(rec: m.StepRecord) -> None:
            ps = eng.pool.page_size
            for r in eng.running:
                cached = sum(eng.pool.owner[p] is m.CACHE for p in r.page_table)
                assert cached * ps <= r.computed == r.target - 1, (r.request_id, cached, r.computed)

        return check

    for k in (0, 3):
        eng = m.Engine([R("a", [1, 2, 3], 9), R("b", [1, 2, 3, 4, 5], 9)], 16, 2, 20, spec_len=k, output_caching=True)
        run(eng, on_step=last_id_outside_the_cache(eng))


def test_m13_n5_the_block_holding_the_ending_id_is_never_published() -> None:
    # EOS at position 9 (after 3 tokens): blocks 0 and 1 are published, block 2 (o2 at 8, EOS at 9) never
    eng = m.Engine([R("a", PROMPT, 10, eos_after=3)], 16, 4, 8, output_caching=True)
    recs = run(eng, on_step=lambda rec: check_cache(eng))
    a = by_id(eng, "a")
    assert (a.finish_reason, a.output_ids, a.computed) == (m.FinishReason.EOS, [*chain(PROMPT, 3), m.EOS_TOKEN_ID], 9)
    assert cached_sequences(eng) == [tuple(PROMPT[:4]), tuple(PROMPT + a.output_ids[:2])]
    assert sum(sum(t.published.values()) for t in recs) == 2 == eng.cache.size
    assert eng.pool.owner.count(None) == 6  # block 2's page was freed at the finish
    # the next turn repeats the answer and its EOS: it reuses blocks 0, 1 and recomputes block 2 only
    turn2 = R("b", [*PROMPT, *a.output_ids, 9, 9], 1)
    eng.add_request(turn2)
    recs = run(eng)
    assert dict(recs[0].reused) == {"b": 8} and sum(t.executed["b"] for t in recs if "b" in t.executed) == 4
    # a stop id and the max_new_tokens-th token end a request the same way
    stop_id = chain(PROMPT, 3)[2]
    for request in (R("s", PROMPT, 10, stop_token_ids=(stop_id,)), R("n", PROMPT, 3)):
        eng = m.Engine([request], 16, 4, 8, output_caching=True)
        run(eng)
        assert request.computed == 8 and request.output_ids == chain(PROMPT, 3)
        assert cached_sequences(eng) == [tuple(PROMPT[:4]), tuple(PROMPT + chain(PROMPT, 2))]
    # with ignore_eos an engine EOS id is an ordinary token, computed and published like any other
    eos_id = chain(PROMPT, 2)[1]
    ends = m.Engine([R("e", PROMPT, 6)], 16, 4, 8, output_caching=True, eos_token_ids=(eos_id,))
    run(ends)
    assert (by_id(ends, "e").output_ids, ends.cache.size) == (chain(PROMPT, 2), 1)
    ignores = m.Engine([R("e", PROMPT, 6, ignore_eos=True)], 16, 4, 8, output_caching=True, eos_token_ids=(eos_id,))
    run(ignores)
    assert by_id(ignores, "e").output_ids == chain(PROMPT, 6)
    assert tuple(PROMPT + chain(PROMPT, 2)) in cached_sequences(ignores)


def test_m13_n6_the_first_publisher_of_a_generated_block_wins_the_other_adopts() -> None:
    a, b = R("a", PROMPT, 7), R("b", PROMPT, 7)
    eng = m.Engine([a, b], 16, 4, 8, output_caching=True)
    tables: list[tuple[list[int], list[int], list[int]]] = []
    recs = run(eng, on_step=lambda rec: tables.append((list(a.page_table), list(b.page_table), list(eng.pool.free))))
    # step 0: both compute the prompt, a publishes block 0, b adopts it (m08); step 2: the same for block 1
    assert [dict(t.published) for t in recs] == [{"a": 1}, {}, {"a": 1}, {}, {}, {}, {"a": 1}]
    a2, b2, free2 = tables[2]
    assert a2[:2] == b2[:2] and eng.pool.owner[a2[1]] is m.CACHE
    a1, b1, _ = tables[1]
    assert b1[1] != a1[1] and b1[1] in free2  # b's own copy of block 1 went back to the free list at once
    assert a.output_ids == b.output_ids == chain(PROMPT, 7) and eng.cache.size == 3


@CI
@given(
    w=workloads(
        min_requests=1,
        pool="tight",
        prompts="shared",
        budget="large",
        spec_len=(1, 3),
        page_size=(1, 3),
        scripts="rollback",
        min_new=3,
        max_new=7,
        output_caching=True,
    )
)
def test_m13_n7_rollback_never_reaches_a_published_block(w: dict) -> None:
    eng = build(m, w, validate=False)
    before: dict[str, tuple[int, list[int]]] = {}

    def snap() -> None:
        before.clear()
        for r in eng.running:
            before[r.request_id] = (r.computed, [p for p in r.page_table if eng.pool.owner[p] is m.CACHE])

    def check(rec: m.StepRecord) -> None:
        for rid, back in rec.rolled_back.items():
            r = by_id(eng, rid)
            computed, cached = before.get(rid, (0, []))
            if rid not in before or r.state is not m.RequestState.RUNNING:
                continue
            assert r.computed > computed, "a decode window keeps at least its first position"
            assert r.page_table[: len(cached)] == cached, (
                f"{rid}: a published block left the table ({back} rolled back)"
            )
        check_cache(eng)
        snap()

    snap()
    run(eng, on_step=check)
    assert all(r.state is FINISHED for r in eng.requests)


def preempted_workload() -> list[m.Request]:
    """r1 (prompt [2]) publishes a block holding 2 generated ids, is preempted when the 3 pages run dry (r0, which
    arrives with it but stands first in the list, is admitted first and so is the anchor: first come, first
    served, D9), reuses that block while cold, loses it to eviction, recomputes and republishes it."""
    return [R("r0", [1, 3, 1], 5), R("r1", [2], 6)]


def test_m13_n8_a_cold_request_reuses_its_whole_known_sequence() -> None:
    eng = m.Engine(preempted_workload(), 5, 3, 3, output_caching=True)
    recs = run(eng, on_step=lambda rec: check_cache(eng))
    r1 = by_id(eng, "r1")
    # preempted at step 3 with 3 ids generated (target 4), when its position 3 needs a second page: m08's cap,
    # (1 - 1) // 3, allows no block; the whole-sequence cap, (4 - 1) // 3, one: the block [2, o0, o1], 2 of its
    # 3 tokens generated, at step 4 (where r0's decode needs a page too and r1 is preempted again)
    assert [t.preempted for t in recs[3:6]] == [("r1",), ("r1",), ()]
    assert [dict(t.reused) for t in recs[3:6]] == [{}, {"r1": 3}, {}]
    assert r1.generated == 6 and recs[2].tokens["r1"] == (chain([2], 3)[2],)
    assert r1.block_keys[0].block_tokens == (2, *chain([2], 2))
    # a request that has generated nothing: m08's rule (the cap leaves the last prompt block to compute)
    fresh = m.Engine([R("a", PROMPT, 2)], 16, 3, 8, output_caching=True)
    run(fresh)
    again = R("b", PROMPT, 2)
    fresh.add_request(again)
    assert dict(run(fresh)[0].reused) == {"b": 3} and again.output_ids == chain(PROMPT, 2)


def test_m13_n9_a_preempted_request_recomputes_and_republishes_with_the_same_ids() -> None:
    eng = m.Engine(preempted_workload(), 5, 3, 3, output_caching=True)
    recs = run(eng, on_step=lambda rec: check_cache(eng))
    r1 = by_id(eng, "r1")
    assert recs[2].published["r1"] == 1  # [2, o0, o1]
    assert recs[3].preempted == ("r1",) and eng.pool.owner.count(None) + eng.cache.size == 3
    # cold, r1 reuses its generated block (page 1) at step 4 but is preempted again: r0's last decode needs its
    # third page and evicts the block (unreferenced once r1 let go), so at step 5 r1 recomputes positions 0..3
    # and publishes the block again
    assert (recs[4].evicted, recs[5].executed["r1"], recs[5].published["r1"]) == ((1,), 4, 1)
    assert cached_sequences(eng)[-1] == (2, *r1.output_ids[:5])
    plain = m12.Engine([m12.Request("r0", [1, 3, 1], 5), m12.Request("r1", [2], 6)], 5, 3, 3)
    run(plain)
    assert [r.output_ids for r in eng.requests] == [r.output_ids for r in plain.requests]
    assert r1.output_ids == chain([2], 6) and eng.summary() == plain.summary()


def test_m13_n10_an_aborted_request_leaves_its_generated_blocks_cached() -> None:
    eng = m.Engine([R("a", PROMPT, 20)], 16, 4, 12, output_caching=True)
    for _ in range(7):
        eng.step()
    a = by_id(eng, "a")
    assert a.computed == 12 and eng.cache.size == 3
    assert eng.abort("a")
    check_cache(eng)
    assert eng.cache.size == 3 and eng.pool.owner.count(m.CACHE) == 3 and not a.page_table
    assert eng.pool.owner.count(None) == 9  # its private partial block went back
    later = R("b", [*PROMPT, *a.output_ids[:6], 7], 1)
    eng.add_request(later)
    recs = run(eng)
    assert recs[0].aborted == ("a",) and dict(recs[0].reused) == {"b": 12}


@CI
@given(
    w=workloads(
        min_requests=2,
        pool="tight",
        prompts="shared",
        page_size=(1, 2),
        max_prompt=6,
        max_new=6,
        spec_len=(0, 2),
        scripts=True,
        output_caching=True,
    )
)
def test_m13_n11_eviction_never_takes_a_block_a_running_table_uses(w: dict) -> None:
    eng = build(m, w, validate=False)
    referenced: dict[int, str] = {}

    def snap() -> None:
        referenced.clear()
        for r in eng.running:
            for p in r.page_table:
                if eng.pool.owner[p] is m.CACHE:
                    referenced[p] = r.request_id

    def check(rec: m.StepRecord) -> None:
        for page in rec.evicted:
            holder = referenced.get(page)
            assert holder is None or holder in rec.preempted, f"evicted page {page} while {holder} used it"
        check_cache(eng)
        snap()

    snap()
    run(eng, on_step=check)
    assert all(r.state is FINISHED for r in eng.requests), "a request that fits the pool on its own must finish"
    # and a decoding request's own generated blocks outlive pressure from a newcomer: here the newcomer waits
    eng = m.Engine([R("a", PROMPT, 10), R("n", [7, 7, 7, 7, 7], 2, arrival_step=7)], 16, 4, 5, output_caching=True)
    recs = run(eng, on_step=lambda rec: check_cache(eng))
    assert all(t.evicted == () or "a" in t.preempted or by_id(eng, "a").state is FINISHED for t in recs)


def test_m13_n12_the_hold_never_waits_for_generated_blocks() -> None:
    # p decodes; r's prompt is p's prompt + p's first 4 ids + 9: it shares 2 prompt blocks with p (computed) and
    # 2 more blocks of p's answer (not yet all computed).  With the hold on it is admitted at once.
    p_ids = chain(PROMPT, 8)
    eng = m.Engine([R("p", PROMPT, 8)], 16, 2, 20, output_caching=True, hold_shared_prefix=True)
    eng.step()
    eng.step()  # p computed position 6 (its first id): blocks 0..2 and... block 3 (6, 7) not yet
    r = R("r", [*PROMPT, *p_ids[:4], 9], 1)
    eng.add_request(r)
    t = eng.step()
    assert t.admitted == ("r",) and not [line for line in t.explain if "held back" in line]
    assert dict(t.reused) == {"r": 6}  # what p had published by then: its prompt's 3 blocks
    run(eng)
    assert r.output_ids == chain(r.tokens, 1) and by_id(eng, "p").output_ids == p_ids
    # the hold still waits for prompt blocks, as in m12
    held = m.Engine(
        [R("p", PROMPT, 1), R("q", [*PROMPT[:4], 8], 1)], 2, 2, 20, output_caching=True, hold_shared_prefix=True
    )
    assert run(held)[0].admitted == ("p",)


def test_m13_n13_published_counts_generated_blocks_and_reused_their_tokens() -> None:
    eng = m.Engine([R("a", [1, 2, 3], 9)], 16, 2, 12, output_caching=True)
    recs = run(eng)
    a = by_id(eng, "a")
    # 3 + 9 ids, the last never computed: 11 computed positions, 5 full blocks, 1 of them prompt only
    assert sum(sum(t.published.values()) for t in recs) == 5 == eng.cache.size
    assert sum(t.published.get("a", 0) for t in recs[1:]) == 4  # the generated ones, after the prefill step
    turn2 = R("b", [1, 2, 3, *a.output_ids, 4], 1)
    eng.add_request(turn2)
    t = run(eng)[0]
    assert dict(t.reused) == {"b": 10} and set(t.to_json()) == set(recs[0].to_json())  # no new field


@CI
@given(
    w=st.one_of(
        workloads(
            prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), output_caching=True
        ),
        workloads(admission=True, prompts="shared", spec_len=(0, 2), scripts=True, output_caching=True),
        workloads(min_requests=2, prompts="shared", pool="fits", page_size=(1, 2), max_new=8, output_caching=True),
    )
)
def test_m13_n14_on_every_request_ends_as_on_m12_and_the_cache_stays_right(w: dict) -> None:
    on = build(m, w, validate=False)
    run(on, on_step=lambda rec: check_cache(on))
    off = build(m12, w, validate=False)
    run(off)
    assert [(r.output_ids, r.finish_reason, r.generated, r.state) for r in on.requests] == [
        (
            r.output_ids,
            r.finish_reason and m.FinishReason(r.finish_reason.value),
            r.generated,
            m.RequestState(r.state.value),
        )
        for r in off.requests
    ]
    assert on.summary() == off.summary()
    assert all(o is None or o is m.CACHE for o in on.pool.owner)
