"""Field cases (tests/data/field-cases.jsonl) that apply at the spec level, on the top rung m12.

Each case gets one test of the case exactly as reported, translated into the spec's terms, and one
hypothesis property covering its whole kind.  The translation: a block is a page (``page_size``),
``num_blocks`` is ``num_pages``, the token budget is ``max_step_tokens``, the engine is m12 with the
built-in scripted executor, and the "deterministic toy LM" is the scripted model, whose ``j``-th id
after a prompt ``p`` is ``scripted_token(previous id, len(p) + j)`` chained from ``p[-1]`` (``chain``).
A request's output is its ``output_ids``; ``generated`` does not count a final EOS or stop id.

Covered here: BC02 (full prefix hit, zero-length query), BC04 (in-flight prefix in one batch), BC06
(preempt and re-prefill), BC11 (oversize request), BC14 (chunked prefill with one output token), BC16
(stop inside an accepted speculative run), BC22 (zero-draft windows beside drafting ones), BC25
(``max_new_tokens`` 0), BC26 (empty prompt).  Beside them, one case of mechserve's own benchmark in
the same style: a burst of requests behind one shared system prompt computes that prompt once with
m12's ``hold_shared_prefix`` (N24).

Not here: BC19 (a stop *string* inside one token's text) needs a tokenizer and detokenised text, and
BC24 (a seeded request's random stream independent of its batchmates) needs a sampler with an RNG; the
spec has neither (its model is greedy and its stop ids are token ids), so both are torch-backend cases
(``tests/field_cases/test_field_case_coverage.py`` lists them as PENDING until a backend test covers them).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from mechserve.spec import m11_parallelism as m11
from mechserve.spec import m12_admission_control as m

R = m.Request
Why = m.RejectReason
TOKEN, EOS, STOP = m.Sample.TOKEN, m.Sample.EOS, m.Sample.STOP
LENGTH = m.FinishReason.LENGTH
FINISHED, REJECTED = m.RequestState.FINISHED, m.RequestState.REJECTED
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENS = st.integers(1, 4)  # a tiny alphabet, so prompts share blocks


def run(eng: m.Engine, limit: int = 500) -> list[m.StepRecord]:
    """``eng.run()``, failing instead of hanging, checking the pool after every step."""

    def watch(rec: m.StepRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        eng.check_invariants()

    return eng.run(on_step=watch)


def chain(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model samples after ``prompt``."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


def copy(r: m.Request) -> m.Request:
    """A fresh request with ``r``'s inputs."""
    script = None if r.accept_script is None else list(r.accept_script)
    return R(
        r.request_id,
        list(r.tokens),
        r.max_new_tokens,
        r.arrival_step,
        r.eos_after,
        script,
        tuple(r.stop_token_ids),
        r.ignore_eos,
    )


def alone(r: m.Request, spec_len: int = 0) -> m.Request:
    """``r`` run by itself on a pool too large to preempt, with no cache hit to take: the reference output."""
    solo = copy(r)
    solo.arrival_step = 0
    run(m.Engine([solo], 64, 4, 64, spec_len=spec_len))
    return solo


def fields_naming(rec: m.StepRecord, rid: str) -> list[str]:
    """The record's fields that mention ``rid`` (``rejected`` holds (id, reason) pairs)."""
    found = []
    for k, v in rec.to_json().items():
        ids = [pair[0] for pair in v] if k == "rejected" else v
        if k != "step" and isinstance(ids, (list, dict)) and rid in ids:
            found.append(k)
    return found


def owners(eng: m.Engine) -> tuple[int, int, int]:
    """(free, private, cache-owned) page counts."""
    own = eng.pool.owner
    return sum(o is None for o in own), sum(isinstance(o, str) for o in own), sum(o is m.CACHE for o in own)


class ReadCheck:
    """The scripted executor, asserting that every position an item reads was written before, at its place.

    An item computes ``[start, start + n)`` and reads every earlier position through its page table;
    each of those slots must hold that position (written by this request or by a cache publisher).
    """

    def __init__(self) -> None:
        self.inner = m.LocalExecutor({}, {})
        self.pool: m.PagePool | None = None
        self.reads = 0

    def execute(self, plan: tuple[m.PlanItem, ...]) -> tuple[m.Outcome, ...]:
        assert self.pool is not None
        for item in plan:
            for pos in range(item.start_position):
                page, offset = m.translate(item.page_table, pos, self.pool.page_size)
                slot = self.pool.slots[page][offset]
                assert slot is not None and slot[1] == pos, f"{item.request_id} reads unwritten position {pos}"
                self.reads += 1
        return self.inner.execute(plan)


def checked_engine(requests: list[m.Request], *args: int, **kw: int) -> tuple[m.Engine, ReadCheck]:
    check = ReadCheck()
    eng = m.Engine(requests, *args, executors=[check], **kw)
    check.pool = eng.pool
    return eng, check


def by_request(recs: list[m.StepRecord], rid: str, field: str) -> Iterator[tuple[int, object]]:
    for rec in recs:
        values = getattr(rec, field)
        if rid in values:
            yield rec.step, values[rid]


# ---- BC02: a block-aligned prompt that is fully cached ----------------------------------------------------


def test_bc02_fully_cached_block_aligned_prompt_computes_its_last_block() -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]  # 8 tokens, 2 blocks of 4
    r1 = R("R1", prompt, 3)
    eng, check = checked_engine([r1], 16, 4, 8)
    run(eng)
    assert (r1.state, eng.cache.size, owners(eng)) == (FINISHED, 2, (6, 0, 2))  # both blocks cached, unreferenced
    r2 = R("R2", list(prompt), 3)
    assert eng.add_request(r2) is None
    recs = run(eng)
    first = recs[0]
    assert dict(first.reused) == {"R2": 4}  # cached tokens <= 7: the last block is recomputed
    assert dict(first.executed) == {"R2": 4}  # >= 1 prompt token: never a zero-length query
    assert dict(first.sampled) == {"R2": TOKEN}
    assert r2.output_ids == r1.output_ids == chain(prompt, 3)
    assert (r2.state, r2.finish_reason, r2.generated) == (FINISHED, LENGTH, 3)
    free, private, cached = owners(eng)
    assert (free + cached, private) == (8, 0)  # free + evictable cached blocks == 8
    assert check.reads > 0


@PROPERTY
@given(
    ps=st.integers(1, 4),
    blocks=st.integers(1, 4),
    data=st.data(),
    max_new=st.integers(1, 4),
    budget=st.integers(1, 16),
    spec_len=st.integers(0, 2),
    overlap=st.booleans(),
)
def test_bc02_every_block_aligned_full_hit_computes_and_matches(
    ps: int, blocks: int, data: st.DataObject, max_new: int, budget: int, spec_len: int, overlap: bool
) -> None:
    """Any block-aligned prompt whose every block is cached (by a longer or equal prompt, while its
    publisher still runs or after it finished) recomputes exactly its last block, reads only written
    KV, and gives the ids of an uncached run."""
    prompt = data.draw(st.lists(TOKENS, min_size=ps * blocks, max_size=ps * blocks))
    longer = prompt + data.draw(st.lists(TOKENS, max_size=2 * ps))
    r1 = R("R1", longer, data.draw(st.integers(1, 4)))
    r2 = R("R2", list(prompt), max_new)
    need = m.pages_for(len(longer) + r1.max_new_tokens - 1, ps) + m.pages_for(len(prompt) + max_new - 1, ps)
    eng, _ = checked_engine([r1], budget, ps, need, spec_len=spec_len)
    while r1.computed < len(prompt) or (not overlap and r1.state is not FINISHED):
        assert eng.step().step < 200, (
            "R1 never published its prompt"
        )  # R1 has published every block of the prompt (and, without overlap, finished)
    assert eng.add_request(r2) is None
    recs = run(eng)
    assert dict(recs[0].reused).get("R2", 0) == (blocks - 1) * ps
    to_first_sample = []
    for rec in recs:
        to_first_sample.append(rec.executed.get("R2", 0))
        if "R2" in rec.sampled:
            break
    assert sum(to_first_sample) == ps  # the whole last block, never 0 tokens
    assert r2.output_ids == alone(r2, spec_len).output_ids == chain(prompt, max_new)
    assert r2.finish_reason is LENGTH
    free, private, cached = owners(eng)
    assert (free + cached, private) == (need, 0)


# ---- BC04: two requests sharing an uncomputed prefix in one batch ---------------------------------------


def test_bc04_in_flight_prefix_is_not_a_hit() -> None:
    shared = [21, 22, 23, 24, 25, 26, 27, 28]
    r1, r2 = R("R1", [*shared, 31, 32], 2), R("R2", [*shared, 41, 42, 43], 2)
    eng, check = checked_engine([r1, r2], 64, 4, 16)
    recs = run(eng)
    t0 = recs[0]
    assert t0.admitted == ("R1", "R2")
    assert dict(t0.reused) == {}  # R2's cached-token count is 0 in step 0
    assert dict(t0.executed) == {"R1": 10, "R2": 11}
    assert sum(t0.executed.values()) == 21
    assert dict(t0.published) == {"R1": 2}  # published after computing; R2 adopts R1's pages (D2)
    assert r2.prompt_keys[:2] and eng.cache.match(r2.prompt_keys) == eng.cache.match(r1.prompt_keys)[:2]
    for r in (r1, r2):
        assert r.output_ids == alone(r).output_ids == chain(r.tokens, 2)
    assert check.reads > 0


@PROPERTY
@given(
    stem=st.lists(TOKENS, min_size=1, max_size=10),
    tails=st.lists(st.lists(TOKENS, max_size=4), min_size=2, max_size=4),
    ps=st.integers(1, 4),
    budget=st.integers(1, 24),
    arrival=st.integers(0, 2),
    max_new=st.integers(1, 3),
)
def test_bc04_same_batch_prefixes_never_read_unwritten_state(
    stem: list[int], tails: list[list[int]], ps: int, budget: int, arrival: int, max_new: int
) -> None:
    """Requests sharing a prefix, admitted together (budget cutting them into chunks or not): nothing
    is reused in their admission step, no item ever reads a slot not yet written, every cache page
    holds what its key says, and every output equals the request's run alone."""
    reqs = [R(f"r{i}", stem + tail, max_new, arrival_step=arrival) for i, tail in enumerate(tails)]
    pages = sum(m.pages_for(len(r.tokens) + max_new - 1, ps) for r in reqs)
    eng, _ = checked_engine(reqs, budget, ps, pages)
    recs = run(eng)
    admission = next(rec for rec in recs if rec.admitted)
    assert dict(admission.reused) == {}
    if budget >= sum(len(r.tokens) for r in reqs):
        assert sum(admission.executed.values()) == sum(len(r.tokens) for r in reqs)
    for key, node in _trie(eng.cache.root, 0):
        assert [eng.pool.slots[node.block][o][1] for o in range(ps)] == [key * ps + o for o in range(ps)]
    for r in reqs:
        assert r.output_ids == alone(r).output_ids


def _trie(children: dict, depth: int) -> Iterator[tuple[int, m.RadixNode]]:
    for node in children.values():
        yield depth, node
        yield from _trie(node.children, depth + 1)


# ---- A burst behind one shared system prompt (the bench's prefix workload in miniature; m12 N24) ---------


def burst() -> list[m.Request]:
    """8 requests at once: a 32-token shared prompt (8 blocks of 4) plus 4 own tokens each, 2 new tokens."""
    shared = list(range(1, 33))
    return [R(f"r{i}", [*shared, *range(100 + 10 * i, 104 + 10 * i)], 2) for i in range(8)]


def prompt_tokens_computed(recs: list[m.StepRecord]) -> int:
    """Prompt positions computed (nothing is preempted here): each request's tokens up to its first sample."""
    total, sampled = 0, set()
    for rec in recs:
        total += sum(n for rid, n in rec.executed.items() if rid not in sampled)
        sampled.update(rec.sampled)
    return total


def test_shared_prefix_burst_computes_the_shared_prompt_once() -> None:
    """``mechserve bench run --workload prefix`` (32 requests, a 1,024-token system prompt, budget 512)
    computed 0.55 of the uncached prefill: request 0 published the prompt's first 512 tokens at step 0,
    the 31 others adopted that partial prefix at step 1 and each computed the second half itself.
    With ``hold_shared_prefix`` they wait until request 0 has published the whole shared prompt."""
    held, check = checked_engine(burst(), 16, 4, 96, hold_shared_prefix=True)
    recs = run(held)
    assert [t.admitted for t in recs[:3]] == [("r0",), (), tuple(f"r{i}" for i in range(1, 8))]
    assert dict(recs[2].reused) == {f"r{i}": 32 for i in range(1, 8)}  # the whole shared prompt
    assert prompt_tokens_computed(recs) == 32 + 8 * 4 == 64  # the shared prompt once, then each suffix
    assert check.reads > 0
    # without the hold r1..r7 adopt the 16 tokens published at step 0 and compute 16 more shared ones each
    plain, _ = checked_engine(burst(), 16, 4, 96)
    plain_recs = run(plain)
    assert dict(plain_recs[1].reused) == {f"r{i}": 16 for i in range(1, 8)}
    assert prompt_tokens_computed(plain_recs) == 36 + 7 * (16 + 4) == 176
    uncached, _ = checked_engine(burst(), 16, 4, 96, prefix_caching=False)
    assert prompt_tokens_computed(run(uncached)) == 8 * 36 == 288
    assert (len(recs), len(plain_recs)) == (6, 13)  # and the burst is served in fewer steps
    for r, ref in zip(held.requests, plain.requests, strict=True):
        assert r.output_ids == ref.output_ids == alone(r).output_ids == chain(r.tokens, 2)


# ---- BC06: preemption and re-prefill neither drop nor repeat a token --------------------------------------


def test_bc06_reprefill_after_preemption_appends_exactly_one_token() -> None:
    # The victim is the request admitted last (first come, first served, D9; requests arriving in the same
    # step are admitted in list order), so R2 stands first in the list and both arrive at step 0: both
    # prefill (R2 2 pages, R1 1), and at step 1, when R1 holds 1 full block + 1 sampled token (len 5), R2's
    # decode needs its 3rd page and R1 its 2nd of the 3: R1, not the anchor, gives its page up.
    r2, r1 = R("R2", list(range(101, 109)), 4), R("R1", [1, 2, 3, 4], 6)
    eng = m.Engine([r2, r1], 16, 4, 3)
    recs: list[m.StepRecord] = []
    while eng.running or eng.waiting:
        recs.append(eng.step())
        assert len(recs) < 200, "the run did not stop"
        for r in eng.running:  # at every step, len(block_table) == ceil(len / 4) for what is computed
            assert len(r.page_table) == m.pages_for(r.computed, 4)
    assert recs[1].preempted == ("R1",)
    assert (r1.generated, len(r1.output_ids)) == (6, 6)
    re_prefill = next(rec for rec in recs[2:] if "R1" in rec.executed)
    assert re_prefill.executed["R1"] == 5  # 4 prompt + 1 generated token recomputed
    assert len(re_prefill.tokens["R1"]) == 1  # and exactly one new token appended: len 6
    assert re_prefill.tokens["R1"] == (chain(r1.tokens, 2)[1],)
    assert r1.output_ids == alone(r1).output_ids == chain(r1.tokens, 6)
    assert (r2.output_ids, r1.finish_reason, r2.finish_reason) == (chain(r2.tokens, 4), LENGTH, LENGTH)


def test_bc06_every_preemption_point_of_the_case() -> None:
    """R1 arriving at each step is preempted at each length 5 … 9 (or never); R1's ids never change.

    First come, first served (D9): R2, admitted first, is the anchor and R1 the only victim, preempted
    when R2's decode takes a page the pool lacks.  So R2 decodes 10 tokens (taking its 3rd, 4th and 5th
    page at steps 1, 5 and 9), long enough to press R1 at every length, and the pool holds 5 or 6 pages.
    """
    want = chain([1, 2, 3, 4], 6)
    points = set()
    for arrival in range(9):
        for pages in (5, 6):
            r2, r1 = R("R2", list(range(101, 109)), 10), R("R1", [1, 2, 3, 4], 6, arrival_step=arrival)
            recs = run(m.Engine([r2, r1], 16, 4, pages))
            assert "R2" not in {rid for rec in recs for rid in rec.preempted}
            hit = [rec.step for rec in recs if "R1" in rec.preempted]
            if hit:
                points.add(sum(rec.executed.get("R1", 0) for rec in recs[: hit[0]]) + 1)
            assert (r1.output_ids, r1.generated) == (want, 6)
            for step, appended in by_request(recs, "R1", "tokens"):
                assert len(appended) == 1, step  # every sampling step, re-prefill included, appends one id
    assert points == {5, 6, 7, 8, 9}


@st.composite
def pressured(draw: st.DrawFn) -> tuple[list[m.Request], int, int, int, int]:
    """Requests over a pool that fits each alone but not all together."""
    ps, k = draw(st.integers(1, 4)), draw(st.integers(0, 2))
    reqs = []
    for i in range(draw(st.integers(2, 5))):
        script = draw(st.none() | st.lists(st.integers(-1, k + 1), max_size=4))
        eos = draw(st.none() | st.integers(0, 6))
        prompt = draw(st.lists(TOKENS, min_size=1, max_size=10))
        reqs.append(R(f"r{i}", prompt, draw(st.integers(1, 6)), draw(st.integers(0, 4)), eos, script))
    biggest = max(m.pages_for(len(r.tokens) + r.max_new_tokens - 1, ps) for r in reqs)
    return reqs, ps, biggest + draw(st.integers(0, 2)), draw(st.integers(1, 16)), k


@PROPERTY
@given(case=pressured())
def test_bc06_any_preemption_point_gives_the_ids_of_a_huge_pool(case: tuple) -> None:
    reqs, ps, pages, budget, k = case
    roomy = [copy(r) for r in reqs]
    tight_eng = m.Engine(reqs, budget, ps, pages, spec_len=k)
    recs = []
    while tight_eng.running or tight_eng.waiting:
        recs.append(tight_eng.step())
        assert len(recs) < 500
        for r in tight_eng.running:
            assert len(r.page_table) == m.pages_for(r.computed, ps)
    run(m.Engine(roomy, budget, ps, 2_000, spec_len=k))
    preempted = sum(len(rec.preempted) for rec in recs)
    event("preempted" if preempted else "no preemption")
    for r, ref in zip(reqs, roomy):
        assert (r.output_ids, r.generated, r.finish_reason) == (ref.output_ids, ref.generated, ref.finish_reason)
        assert r.generated <= r.max_new_tokens
    for rec in recs:
        for rid, appended in rec.tokens.items():
            assert len(appended) == 1 + rec.accepted.get(rid, 0)  # a recompute appends exactly its one sample


# ---- BC11: a request larger than the pool must not block the queue ---------------------------------------


def test_bc11_oversize_request_is_rejected_and_the_queue_moves() -> None:
    # 4 blocks of 16 = 64 usable slots (the spec reserves no null block: num_pages is the usable count)
    r1, r2 = R("R1", [7] * 100, 8), R("R2", list(range(1, 11)), 4, arrival_step=1)
    eng = m.Engine([r1, r2], 64, 16, 4, max_model_len=256)
    assert (r1.state, r1.reject_reason) == (REJECTED, Why.NEVER_FITS)  # 100 + 8 <= 256, but 107 slots > 64
    recs = []
    while eng.running or eng.waiting or eng.step_counter == 0:
        recs.append(eng.step())
        assert len(recs) < 200, "the run did not stop"
        assert eng.running or not eng.due  # never zero running while an arrived request waits
    assert dict(recs[0].rejected) == {"R1": Why.NEVER_FITS}
    assert all(fields_naming(rec, "R1") == (["rejected"] if rec.step == 0 else []) for rec in recs)
    assert r1.page_table == [] and all(o != "R1" for o in eng.pool.owner)
    assert [rec.step for rec in recs if "R2" in rec.executed] == [1, 2, 3, 4]  # prefill + 3 decodes
    assert (r2.state, r2.generated, r2.output_ids) == (FINISHED, 4, chain(r2.tokens, 4))
    # the bound is the usable pool exactly: a frontier of 64 slots is served, 65 is refused
    edge = m.Engine([R("fits", [1] * 60, 5), R("over", [2] * 60, 6)], 64, 16, 4)
    assert [r.state for r in edge.requests] == [m.RequestState.WAITING, REJECTED]
    run(edge)
    assert edge.requests[0].generated == 5
    # m11 accepted R1 and failed the whole run once it became the anchor: R2 never finished
    old = m11.Engine([m11.Request("R1", [7] * 100, 8), m11.Request("R2", list(range(1, 11)), 4, 1)], 64, 16, 4)
    with pytest.raises(m11.Irreducible):
        old.run()
    assert old.requests[1].state is not m11.RequestState.FINISHED


@st.composite
def with_oversize(draw: st.DrawFn) -> tuple[list[tuple[int, m.Request, bool]], int, int, int]:
    """Fitting and oversize requests, each offered at construction (-1) or before some step."""
    ps, pages = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    offers = []
    for i in range(draw(st.integers(1, 7))):
        big = draw(st.booleans())
        prompt = draw(st.lists(TOKENS, min_size=1, max_size=12 if big else min(12, pages * ps)))
        limit = pages * ps - len(prompt) + 1  # the most new tokens that still fit
        if big:
            max_new = draw(st.integers(max(1, limit + 1), max(1, limit + 1) + 3))
        else:
            max_new = draw(st.integers(1, min(limit, 5)))
        offers.append((draw(st.integers(-1, 4)), R(f"r{i}", prompt, max_new, draw(st.integers(0, 3))), big))
    return offers, ps, pages, draw(st.integers(1, 12))


@PROPERTY
@given(case=with_oversize())
def test_bc11_any_oversize_request_is_rejected_and_the_others_finish(case: tuple) -> None:
    offers, ps, pages, budget = case
    mixed = m.Engine([r for when, r, _ in offers if when < 0], budget, ps, pages)
    plain = m.Engine([copy(r) for when, r, big in offers if when < 0 and not big], budget, ps, pages)
    mixed_recs, plain_recs = [], []
    for step in range(400):
        for when, r, big in offers:
            if when == step:
                mixed.add_request(r)
                if not big:
                    plain.add_request(copy(r))
        if step > 4 and not (mixed.running or mixed.waiting):
            break
        mixed_recs.append(mixed.step().to_json())
        plain_recs.append(plain.step().to_json())
        assert mixed.running or not mixed.due
    for _, r, big in offers:
        assert r.state is (REJECTED if big else FINISHED)
        if big:
            assert (r.reject_reason, r.page_table, r.computed) == (Why.NEVER_FITS, [], 0)
    for rec in mixed_recs:
        rec.pop("rejected")
    for rec in plain_recs:
        rec.pop("rejected")
    assert mixed_recs == plain_recs  # the fitting requests never notice the oversize ones


# ---- BC14: chunked prefill of a one-token request samples once, at the final chunk -------------------------


def test_bc14_chunked_prefill_with_max_tokens_1_samples_at_the_last_chunk() -> None:
    prompt = list(range(1, 11))
    r1 = R("R1", prompt, 1)
    recs = run(m.Engine([r1], 4, 4, 8))
    assert [dict(rec.executed) for rec in recs] == [{"R1": 4}, {"R1": 4}, {"R1": 2}]  # chunks 4/4/2
    assert [dict(rec.sampled) for rec in recs] == [{}, {}, {"R1": TOKEN}]  # no output at steps 0-1
    assert [dict(rec.tokens) for rec in recs] == [{}, {}, {"R1": (chain(prompt, 1)[0],)}]
    whole = R("R1", list(prompt), 1)
    run(m.Engine([whole], 10, 4, 8))
    assert r1.output_ids == whole.output_ids  # the first token of an unchunked run
    assert (r1.finish_reason, r1.generated, len(r1.output_ids)) == (LENGTH, 1, 1)


@PROPERTY
@given(
    prompt=st.lists(TOKENS, min_size=1, max_size=30),
    budget=st.integers(1, 12),
    ps=st.integers(1, 4),
    max_new=st.integers(1, 3),
    k=st.integers(0, 2),
    script=st.lists(st.integers(0, 2), min_size=1, max_size=3),
)
def test_bc14_no_prefill_chunk_but_the_last_ever_samples(
    prompt: list[int], budget: int, ps: int, max_new: int, k: int, script: list[int]
) -> None:
    """Whatever the chunking: nothing is sampled or appended before the prompt is complete, the first
    id is the unchunked run's, a one-token request samples exactly once, and no prefill chunk consumes
    a verifier verdict (the spec's stand-in for RNG state): the first decode window uses entry 0."""
    r = R("r", prompt, max_new, accept_script=list(script))
    recs = run(m.Engine([r], budget, ps, m.pages_for(len(prompt) + max_new - 1, ps), spec_len=k))
    done = 0
    for rec in recs:
        done += rec.executed.get("r", 0)
        if done < len(prompt):
            assert "r" not in rec.sampled and "r" not in rec.tokens
        else:
            assert "r" in rec.sampled  # the step that completes the prompt samples
            break
    assert r.output_ids == chain(prompt, max_new)
    samples = [step for step, _ in by_request(recs, "r", "sampled")]
    if max_new == 1:
        assert (len(samples), r.finish_reason) == (1, LENGTH)
    windows = list(by_request(recs, "r", "drafted"))
    if windows:
        step, drafted = windows[0]
        assert recs[step].accepted["r"] == max(0, min(script[0], drafted))


# ---- BC16: a stop id inside an accepted speculative run cuts it; the cap never masks it -------------------


def test_bc16_stop_inside_an_accepted_run_wins_over_the_cap() -> None:
    prompt = [1, 2, 3, 4]
    ids = chain(prompt, 6)  # the prefill samples ids[0]; step 1 verifies a run of 3 drafts + bonus
    r1 = R("R1", prompt, 5, stop_token_ids=(ids[2],))
    recs = run(m.Engine([r1], 16, 4, 8, spec_len=5))
    t1 = recs[1]
    assert (t1.drafted["R1"], t1.accepted["R1"], t1.rolled_back["R1"]) == (3, 1, 2)
    assert (t1.tokens["R1"], dict(t1.sampled)) == ((ids[1], ids[2]), {"R1": STOP})
    assert (r1.finish_reason, r1.output_ids) == (m.FinishReason.STOP, ids[:3])  # [10, 11, STOP]: 3 tokens
    assert len(recs) == 2  # nothing after the stop
    # control: a stop id at index >= 5 is never reached; LENGTH after exactly the first 5 tokens
    ctl = R("R1", prompt, 5, stop_token_ids=(ids[5],))
    run(m.Engine([ctl], 16, 4, 8, spec_len=5))
    assert (ctl.finish_reason, ctl.output_ids) == (LENGTH, ids[:5])
    # sibling: an EOS id inside the accepted run wins over the cap as well
    eos = R("R1", prompt, 5)
    run(m.Engine([eos], 16, 4, 8, spec_len=5, eos_token_ids=(ids[2],)))
    assert (eos.finish_reason, eos.output_ids, eos.generated) == (m.FinishReason.EOS, ids[:3], 2)


@PROPERTY
@given(
    prompt=st.lists(TOKENS, min_size=1, max_size=8),
    k=st.integers(1, 5),
    max_new=st.integers(1, 10),
    data=st.data(),
    as_eos=st.booleans(),
    script=st.none() | st.lists(st.integers(-1, 6), max_size=5),
    budget=st.integers(1, 20),
)
def test_bc16_a_stop_at_any_index_ends_the_output_there(
    prompt: list[int],
    k: int,
    max_new: int,
    data: st.DataObject,
    as_eos: bool,
    script: list[int] | None,
    budget: int,
) -> None:
    """A stop (or EOS) id at any output index, inside an accepted run, at a bonus token or past the
    cap: the output ends at the earliest of stop and cap, and nothing after it is ever appended."""
    index = data.draw(st.integers(0, max_new + 2), label="index")
    ids = chain(prompt, 13)
    first = ids.index(ids[index])
    kw = {"eos_token_ids": (ids[index],)} if as_eos else {}
    r = R("r", prompt, max_new, accept_script=script, stop_token_ids=() if as_eos else (ids[index],))
    recs = run(m.Engine([r], budget, 4, m.pages_for(len(prompt) + max_new - 1, 4), spec_len=k, **kw))
    if first < max_new:
        reason = m.FinishReason.EOS if as_eos else m.FinishReason.STOP
        assert (r.finish_reason, r.output_ids, r.generated) == (reason, ids[: first + 1], first)
        assert recs[-1].tokens["r"][-1] == ids[first]
        event(f"the stop came after {len(recs[-1].tokens['r']) - 1} accepted guess(es) in its step")
    else:
        assert (r.finish_reason, r.output_ids, r.generated) == (LENGTH, ids[:max_new], max_new)
    assert sum(len(t) for _, t in by_request(recs, "r", "tokens")) == len(r.output_ids)


# ---- BC22: windows without drafts beside windows with drafts ----------------------------------------------


def test_bc22_zero_draft_windows_mix_with_drafting_ones() -> None:
    # an empty proposal is a window whose guesses are all rejected (verdict 0): B's at steps 3 and 4
    a, b = R("A", [1, 2, 3, 4], 3, accept_script=[0]), R("B", [5, 6, 7, 8], 10, accept_script=[2, 2, 0, 0])
    recs = run(m.Engine([a, b], 64, 4, 16, spec_len=2))
    assert [dict(rec.drafted) for rec in recs] == [{}, {"A": 1, "B": 2}, {"A": 0, "B": 2}, {"B": 2}, {"B": 1}, {"B": 0}]
    assert dict(recs[2].finished) == {"A": LENGTH}  # A's last step: 0 drafts while B has 2
    assert [dict(rec.accepted) for rec in recs[3:]] == [{"B": 0}, {"B": 0}, {"B": 0}]
    assert (dict(recs[5].executed), len(recs[5].tokens["B"])) == ({"B": 1}, 1)  # all-zero step: plain decode
    assert (a.generated, len(a.output_ids), b.generated, len(b.output_ids)) == (3, 3, 10, 10)
    solo = R("B", [5, 6, 7, 8], 10, accept_script=[2, 2, 0, 0])
    solo_recs = run(m.Engine([solo], 64, 4, 16, spec_len=2))
    assert [rec.accepted.get("B") for rec in solo_recs] == [rec.accepted.get("B") for rec in recs]
    assert b.output_ids == solo.output_ids == chain(b.tokens, 10)


@PROPERTY
@given(
    specs=st.lists(
        st.tuples(st.lists(TOKENS, min_size=1, max_size=6), st.integers(1, 8), st.none() | st.lists(st.integers(0, 3))),
        min_size=2,
        max_size=4,
    ),
    k=st.integers(1, 3),
    budget=st.integers(1, 40),
)
def test_bc22_any_mix_of_draft_lengths_returns_exactly_max_new(specs: list, k: int, budget: int) -> None:
    reqs = [R(f"r{i}", p, n, accept_script=s) for i, (p, n, s) in enumerate(specs)]
    pages = sum(m.pages_for(len(r.tokens) + r.max_new_tokens - 1, 4) for r in reqs)
    recs = run(m.Engine(reqs, budget, 4, pages, spec_len=k))
    for rec in recs:
        assert set(rec.drafted) == set(rec.accepted) == set(rec.rolled_back)
        if rec.drafted and not any(rec.drafted.values()):
            event("a step where every window has 0 drafts")
            for rid in rec.drafted:
                assert (rec.executed[rid], len(rec.tokens[rid])) == (1, 1)  # plain decode
        if 0 in rec.drafted.values() and any(rec.drafted.values()):
            event("0 drafts beside drafts")
    for r in reqs:
        assert (r.generated, r.finish_reason, r.output_ids) == (
            r.max_new_tokens,
            LENGTH,
            chain(r.tokens, r.max_new_tokens),
        )


# ---- BC25: max_new_tokens == 0 ------------------------------------------------------------------------------


def test_bc25_zero_new_tokens_returns_nothing_and_leaks_nothing() -> None:
    r1, r2 = R("R1", [1, 2, 3, 4, 5], 0), R("R2", [1, 2, 3, 4, 6], 2, arrival_step=1)
    eng = m.Engine([r1, r2], 8, 4, 8)
    t0 = eng.step()
    assert (t0.admitted, dict(t0.finished), dict(t0.sampled), dict(t0.executed)) == (("R1",), {"R1": LENGTH}, {}, {})
    assert len(eng.pool.free) == 8  # no page was ever taken
    assert (r1.output_ids, r1.generated, r1.finish_reason) == ([], 0, LENGTH)
    assert not eng.abort("R1")  # finished: nothing left to abort
    recs = run(eng)
    assert all(fields_naming(rec, "R1") == [] for rec in recs)
    assert (r2.output_ids, r2.finish_reason) == (alone(r2).output_ids, LENGTH)
    assert len(r2.output_ids) == 2


@PROPERTY
@given(
    specs=st.lists(
        st.tuples(st.lists(TOKENS, min_size=1, max_size=40), st.integers(0, 3), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    ),
    ps=st.integers(1, 4),
    budget=st.integers(1, 16),
)
def test_bc25_zero_token_requests_finish_at_admission_among_any_others(specs: list, ps: int, budget: int) -> None:
    reqs = [R(f"r{i}", p[:12] if n else p, n, arrival_step=a) for i, (p, n, a) in enumerate(specs)]
    pages = sum(m.pages_for(len(r.tokens) + r.max_new_tokens - 1, ps) for r in reqs if r.max_new_tokens)
    eng = m.Engine(reqs, budget, ps, max(1, pages))
    recs = run(eng)
    for r in reqs:
        if r.max_new_tokens:
            assert r.output_ids == alone(r).output_ids
            continue
        named = [(rec.step, fields_naming(rec, r.request_id)) for rec in recs if fields_naming(rec, r.request_id)]
        assert named == [(r.arrival_step, ["admitted", "finished"])]
        assert (r.state, r.finish_reason, r.generated, r.computed, r.output_ids) == (FINISHED, LENGTH, 0, 0, [])


# ---- BC26: an empty prompt is refused while the engine keeps serving ---------------------------------------


def test_bc26_empty_prompt_is_rejected_and_the_engine_keeps_serving() -> None:
    eng = m.Engine([], 8, 4, 8)
    r1, r2 = R("R1", [], 5), R("R2", [1, 2, 3, 4], 3)
    assert eng.add_request(r1) is Why.EMPTY_PROMPT  # rejected immediately, at the door
    assert eng.add_request(r2) is None
    t0 = eng.step()
    assert dict(t0.rejected) == {"R1": Why.EMPTY_PROMPT}
    assert fields_naming(t0, "R1") == ["rejected"]
    late, after = R("R3", [], 1), R("R4", [9, 9], 2)
    assert eng.add_request(late) is Why.EMPTY_PROMPT  # again, mid-run
    assert eng.add_request(after) is None
    recs = run(eng)
    assert all(fields_naming(rec, "R1") == [] for rec in recs)
    assert dict(recs[0].rejected) == {"R3": Why.EMPTY_PROMPT}
    assert (r1.state, r1.page_table, r1.computed) == (REJECTED, [], 0)
    assert (r2.state, r2.generated, r2.output_ids) == (FINISHED, 3, chain(r2.tokens, 3))
    assert (after.state, after.output_ids) == (FINISHED, chain(after.tokens, 2))


@PROPERTY
@given(
    valid=st.lists(st.tuples(st.lists(TOKENS, min_size=1, max_size=8), st.integers(1, 4)), min_size=1, max_size=5),
    invalid=st.lists(st.tuples(st.integers(0, 6), st.booleans(), st.integers(-3, 3)), min_size=1, max_size=5),
    ps=st.integers(1, 4),
    budget=st.integers(1, 16),
)
# CI's hypothesis found it: 46 tokens at a budget of 1 need more steps than the loop's old bound of 40
@example(
    valid=[([1, 1, 1, 2], 4), ([1] * 8, 3), ([1, 1, 2, 1, 1, 1, 1, 1], 4), ([1, 1, 1, 1], 1), ([1, 1, 1, 3, 1, 1], 4)],
    invalid=[(0, False, 0)],
    ps=4,
    budget=1,
)
def test_bc26_invalid_requests_at_any_time_leave_the_others_untouched(
    valid: list, invalid: list, ps: int, budget: int
) -> None:
    """Empty prompts and negative ``max_new_tokens``, offered before any step: each is refused with
    its reason in the next record, and the valid requests' trace is that of a run without them."""
    pages = sum(m.pages_for(len(p) + n - 1, ps) for p, n in valid)
    mixed = m.Engine([R(f"v{i}", p, n) for i, (p, n) in enumerate(valid)], budget, ps, pages)
    plain = m.Engine([R(f"v{i}", list(p), n) for i, (p, n) in enumerate(valid)], budget, ps, pages)
    mixed_recs, plain_recs = [], []
    # steps enough for every token twice at a budget of 1, after the last invalid arrival (the loop ends when done)
    for step in range(2 * sum(len(p) + n for p, n in valid) + 8):
        expected = {}
        for i, (when, empty, max_new) in enumerate(invalid):
            if when == step and (empty or max_new < 0):
                bad = R(f"x{i}", [] if empty else [1], max_new)
                why = Why.EMPTY_PROMPT if empty else Why.BAD_MAX_NEW_TOKENS
                assert mixed.add_request(bad) is why
                expected[bad.request_id] = why
        if not (mixed.running or mixed.waiting or expected):
            break
        rec = mixed.step().to_json()
        assert rec.pop("rejected") == [[rid, why.value] for rid, why in expected.items()]
        mixed_recs.append(rec)
        plain_recs.append(plain.step().to_json())
    for rec in plain_recs:
        rec.pop("rejected")
    assert mixed_recs == plain_recs
    assert all(r.state in (FINISHED, REJECTED) for r in mixed.requests)
