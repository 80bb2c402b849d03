"""The top rungs' edges that mutation testing found untested (docs/mutation.md), on m13 and on m14, whose
engine is m13's plus forced runs (the same code copied into both files, so each rung's mutants need their
own case): the engine's own refusals, an object offered twice, ``abort`` of an unknown id,
``drop_finished``, a hold on a one-block prompt, whether a draft is said to be capped, what a stop from
outside leaves in ``generated`` when it cuts off the EOS or stop id the request had just finished on, the
contract's refusals by message (the cache's, ``join``'s, the boundary's, the stop's), and
``check_invariants`` failing on each kind of corruption."""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

import pytest

RUNGS = ["m13_output_caching", "m14_forced_runs", "m16_request_draft_lengths"]


@pytest.fixture(params=RUNGS)
def m(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(f"mechserve.spec.{request.param}")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"spec_len": -1}, "spec_len must be >= 0"),
        ({"max_step_tokens": 0}, "max_step_tokens must be > 0"),
        ({"num_pages": 0}, "num_pages must be > 0"),
        ({"page_size": 0}, "page_size must be > 0"),
        ({"world_size": 0}, "world_size must be > 0"),
        ({"max_waiting": 0}, "max_waiting must be > 0"),
        ({"max_running": 0}, "max_running must be > 0"),
        ({"max_model_len": 0}, "max_model_len must be > 0"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_name(m: Any, setting: dict[str, int], message: str) -> None:
    kwargs = {"max_step_tokens": 4, "page_size": 2, "num_pages": 8} | setting
    with pytest.raises(ValueError, match=f"^{message}$"):
        m.Engine([], **kwargs)


def test_each_setting_at_its_least_value_is_accepted(m: Any) -> None:
    least = {"max_step_tokens": 1, "page_size": 1, "num_pages": 1, "spec_len": 0, "world_size": 1}
    least |= {"max_waiting": 1, "max_running": 1, "max_model_len": 1}
    eng = m.Engine([], **least)
    assert {k: getattr(eng.pool if k in ("page_size", "num_pages") else eng, k) for k in least} == least


def test_output_caching_is_off_unless_asked_for(m: Any) -> None:
    # a 5-token prompt and 6 generated tokens, pages of 2: by default only the prompt's 2 complete blocks are
    # published; with output caching the generated ones too
    for given, blocks in (({}, 2), ({"output_caching": True}, 5)):
        eng = m.Engine([m.Request("a", [1, 2, 3, 4, 5], 6)], 8, 2, 16, **given)
        eng.run()
        assert (eng.output_caching, eng.cache.size) == (bool(given), blocks)


def test_as_many_rank_executors_as_ranks_or_a_refusal_naming_both(m: Any) -> None:
    one = [m.LocalExecutor({}, {})]
    with pytest.raises(ValueError, match=r"^1 rank executor\(s\) for world_size 2$"):
        m.Engine([], 4, 2, 8, world_size=2, executors=one)
    assert m.Engine([], 4, 2, 8, world_size=1, executors=one).executor is not None


def test_the_namespace_scopes_every_prefix_key(m: Any) -> None:
    for given, used in ((None, "engine"), ("tenant-a", "tenant-a")):
        eng = m.Engine([m.Request("a", [1, 2, 3, 4, 5], 1)], 8, 2, 8, namespace=given)
        eng.run()
        keys = eng.requests[0].prompt_keys
        assert eng.namespace == used and len(keys) == 2 and {k.namespace for k in keys} == {used}
        assert eng.cache.match(m.prefix_keys([1, 2, 3, 4], 2, used)) == eng.cache.match(keys) != []


def test_a_request_object_with_output_already_is_not_offered_again(m: Any) -> None:
    eng = m.Engine([], 4, 2, 8)
    used = m.Request("a", [1, 2, 3], 2)
    used.output_ids = [5]  # still WAITING, but it has run before
    with pytest.raises(ValueError, match="offered before"):
        eng.add_request(used)


def test_the_same_request_object_is_not_offered_twice(m: Any) -> None:
    eng = m.Engine([], 4, 2, 8)
    r = m.Request("a", [1, 2, 3], 2)
    assert eng.add_request(r) is None
    with pytest.raises(ValueError, match=r"^request object 'a' was offered before; offer a new Request$"):
        eng.add_request(r)  # still waiting, no output yet
    assert [x.request_id for x in eng.requests] == ["a"]


def test_the_door_checks_each_limit_at_its_boundary(m: Any) -> None:
    R, why = m.Request, m.RejectReason
    # prompt + max_new_tokens == max_model_len fits; one more does not
    eng = m.Engine([], 8, 2, 16, max_model_len=6)
    assert eng.add_request(R("a", [1, 2, 3], 3)) is None
    assert eng.add_request(R("b", [1, 2, 3], 4)) is why.TOO_LONG
    # two pages of 2: 0 tokens need no page; a prompt of 5 and 1 token needs pages_for(5) = 3
    eng = m.Engine([], 8, 2, 2)
    assert eng.add_request(R("z", [1, 2, 3, 4, 5, 6], 0)) is None
    assert eng.add_request(R("n", [1, 2, 3, 4, 5], 1)) is why.NEVER_FITS
    # max_waiting counts the waiting and the due: a runs, b is due, c waits for its arrival step
    eng = m.Engine([R("a", [1, 2, 3], 4)], 8, 2, 16, max_waiting=2, max_running=1)
    eng.step()
    assert eng.add_request(R("b", [4, 5], 2)) is None and eng.add_request(R("c", [6, 7], 2, arrival_step=9)) is None
    eng.step()
    assert ([r.request_id for r in eng.due], len(eng.waiting)) == (["b"], 1)
    assert eng.add_request(R("d", [8, 9], 2)) is why.OVERLOADED
    eng = m.Engine([], 8, 2, 16, max_waiting=1)
    assert eng.add_request(R("a", [1, 2], 2)) is None and eng.add_request(R("b", [1, 2], 2)) is why.OVERLOADED


def test_a_reused_request_id_inherits_nothing_of_the_scripts_of_the_request_before(m: Any) -> None:
    scripted = {"eos_after": 1, "accept_script": [0, 0, 0]}
    if "forced_script" in m.Request.__dataclass_fields__:
        scripted["forced_script"] = {0: (7, 7)}
    if "draft_limit_script" in m.Request.__dataclass_fields__:  # m16: no guesses, for more decisions than it makes
        scripted["draft_limit_script"] = [0] * 6
    eng = m.Engine([m.Request("a", [1, 2, 3], 6, **scripted)], 8, 2, 16, spec_len=2)
    eng.run()
    again = m.Request("a", [1, 2, 3], 6)
    eng.add_request(again)
    verdicts = [dict(rec.accepted) for rec in eng.run() if rec.accepted]
    fresh = m.Engine([m.Request("a", [1, 2, 3], 6)], 8, 2, 16, spec_len=2)
    assert verdicts == [dict(rec.accepted) for rec in fresh.run() if rec.accepted]  # every guess accepted
    assert (again.output_ids, again.finish_reason) == (fresh.requests[0].output_ids, m.FinishReason.LENGTH)
    assert 7 not in again.output_ids and len(again.output_ids) == 6


def test_abort_of_an_unknown_or_finished_request_is_false(m: Any) -> None:
    eng = m.Engine([m.Request("a", [1, 2, 3], 1)], 4, 2, 8)
    assert eng.abort("nobody") is False
    eng.run()
    assert eng.abort("a") is False
    assert [r.state for r in eng.requests] == [m.RequestState.FINISHED]


def test_abort_takes_a_waiting_or_due_request_out_of_its_queue(m: Any) -> None:
    # max_running 1: after step 0, b has arrived and waits for the running slot (due); c arrives at step 5
    reqs = [m.Request("a", [1, 2, 3], 4), m.Request("b", [4, 5, 6], 4), m.Request("c", [7, 8, 9], 4, arrival_step=5)]
    eng = m.Engine(reqs, 8, 2, 16, max_running=1)
    eng.step()
    assert [r.request_id for r in eng.due] == ["b"] and [entry[2].request_id for entry in eng.waiting] == ["c"]
    assert eng.abort("c") is True
    assert ([r.request_id for r in eng.due], eng.waiting, list(eng.live)) == (["b"], [], ["a", "b"])
    assert eng.abort("b") is True
    assert (eng.due, eng.waiting, list(eng.live)) == ([], [], ["a"])
    rec = eng.step()
    assert rec.aborted == ("c", "b") and rec.admitted == () and "b was aborted." in rec.explain
    eng.run()
    states = [(r.state, r.draft_len, r.output_ids, r.page_table) for r in reqs[1:]]
    assert reqs[0].state is m.RequestState.FINISHED and states == [(m.RequestState.ABORTED, 0, [], [])] * 2


def test_drop_finished_lets_go_once_the_leaving_is_recorded(m: Any) -> None:
    eng = m.Engine([m.Request("a", [1, 2, 3], 1), m.Request("b", [1, 2, 3, 4, 5, 6, 7], 8)], 4, 2, 8)
    assert eng.drop_finished() == []
    eng.step()
    eng.step()
    assert [r.request_id for r in eng.drop_finished()] == ["a"]
    assert [r.request_id for r in eng.requests] == ["b"]
    assert eng.abort("b") is True
    assert eng.drop_finished() == []  # the abort is recorded in the next step first
    assert eng.step().aborted == ("b",)
    assert [r.request_id for r in eng.drop_finished()] == ["b"] and eng.requests == []


def test_a_one_block_prompt_is_held_while_its_block_is_computed(m: Any) -> None:
    # pages of 4, budget 3: p has computed positions 0..2 of block 0 when q, whose one usable block is p's
    # block 0, arrives; q waits for it instead of computing it again
    eng = m.Engine([m.Request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)], 3, 4, 16, hold_shared_prefix=True)
    eng.step()
    eng.add_request(m.Request("q", [1, 2, 3, 4, 5], 1))
    t1 = eng.step()
    assert t1.admitted == () and any(line.startswith("q is held back: p") for line in t1.explain)
    t2 = eng.step()
    assert (t2.admitted, dict(t2.reused)) == (("q",), {"q": 4})


def test_a_request_is_held_for_the_leading_blocks_it_shares_though_the_next_differs(m: Any) -> None:
    # q's two usable blocks: block 0 is p's (p is computing it), block 1 is q's own; q waits for block 0
    eng = m.Engine([m.Request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)], 3, 4, 16, hold_shared_prefix=True)
    eng.step()
    eng.add_request(m.Request("q", [1, 2, 3, 4, 50, 60, 70, 80, 90], 1))
    t1 = eng.step()
    held = "q is held back: p is still computing the 1 prompt block(s) they share (0 cached); q will reuse them"
    assert t1.admitted == () and any(line.startswith(held) for line in t1.explain)
    t2 = eng.step()
    assert (t2.admitted, dict(t2.reused)) == (("q",), {"q": 4})


def test_requests_arriving_together_are_held_behind_the_one_admitted_first_and_the_limit_keeps_the_rest(
    m: Any,
) -> None:
    # all arrive at step 0, max_running 3: a is admitted and its prompt blocks are pending at once, so c and
    # d (a's prompt; d asks for 1 token) are held behind it and z (a's prompt, 0 tokens) finishes at
    # admission; the walk goes on past the held: e and f are admitted, and g finds the limit reached
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    reqs = [m.Request("a", shared, 2), m.Request("c", shared, 2), m.Request("d", shared, 1)]
    reqs += [m.Request("z", shared, 0), m.Request("e", [20, 21, 22], 2), m.Request("f", [30, 31, 32], 2)]
    reqs += [m.Request("g", [40, 41, 42], 2)]
    eng = m.Engine(reqs, 8, 4, 32, max_running=3, hold_shared_prefix=True)
    t0 = eng.step()
    assert (t0.admitted, dict(t0.finished)) == (("a", "z", "e", "f"), {"z": m.FinishReason.LENGTH})
    held = [line for line in t0.explain if "held back" in line or "wait:" in line]
    assert held == [
        "c is held back: a is still computing the 2 prompt block(s) they share (0 cached); c will reuse them "
        "once they are published.",
        "d is held back: a is still computing the 2 prompt block(s) they share (0 cached); d will reuse them "
        "once they are published.",
        "1 arrived request(s) wait: 3 running is the max_running limit.",
    ]
    assert [r.request_id for r in eng.due] == ["c", "d", "g"]
    eng.run()
    assert all(r.finish_reason is m.FinishReason.LENGTH for r in reqs) and not eng.live


def test_each_plan_item_places_exactly_its_own_positions_through_its_request_page_table(m: Any) -> None:
    # budget 3 cuts prompts into chunks (start > 0), a pool of 6 pages preempts, spec_len 2 runs windows,
    # b reuses a's published block: every item writes positions start..start+n-1, each to the slot its
    # request's page table gives it, and carries that table whole
    reqs = [m.Request("a", [1, 2, 3, 4, 5, 6, 7], 5), m.Request("b", [1, 2, 3, 4, 9, 9], 5, arrival_step=2)]
    eng = m.Engine(reqs, 3, 2, 6, spec_len=2)
    starts, records = set(), []
    while eng.live:
        assert eng.step_counter < 100
        plan = eng.schedule()
        tables = {r.request_id: tuple(r.page_table) for r in eng.running}
        for item in plan:
            table = tables[item.request_id]
            positions = range(item.start_position, item.start_position + item.num_tokens)
            assert item.page_table == table
            assert item.placements == tuple((p, table[p // 2], p % 2) for p in positions)
            starts.add(item.start_position > 0 and not item.decode)
        records.append(eng.commit(eng.executor.execute(plan)))
    assert starts == {True, False}  # a prefill chunk that starts past 0, and one that starts at 0
    assert all(any(getattr(rec, what) for rec in records) for what in ("preempted", "reused", "drafted"))


def test_a_draft_is_said_to_be_capped_only_when_max_new_tokens_cut_it(m: Any) -> None:
    # spec_len 2: after its first sample, a (10 new tokens) asks for both guesses; b (3 new tokens) may
    # draft only 1, since its window's bonus sample would otherwise pass max_new_tokens
    eng = m.Engine([m.Request("a", [1, 2, 3], 10), m.Request("b", [4, 5, 6], 3)], 8, 4, 16, spec_len=2)
    eng.step()
    said = [line for line in eng.step().explain if "caught up" in line]
    assert said == [
        "a is caught up and asks for 2 guess(es).",
        "b is caught up and asks for 1 guess(es) (capped so it cannot pass max_new_tokens).",
    ]


def test_eos_after_cuts_an_accepted_run_that_ignores_eos_ids(m: Any) -> None:
    # ignore_eos: the EOS id is an ordinary token, so only eos_after (the scripted model's trigger) ends a;
    # its window at step 1 has guesses accepted past eos_after: the clamp keeps one, the sample is EOS
    eng = m.Engine([m.Request("a", [1, 2, 3], 8, eos_after=2, ignore_eos=True)], 8, 4, 16, spec_len=2)
    records = eng.run()
    a = eng.requests[0]
    assert (a.generated, len(a.output_ids), a.output_ids[-1], a.finish_reason) == (2, 3, 0, m.FinishReason.EOS)
    assert (records[1].drafted, records[1].accepted, records[1].finished) == (
        {"a": 2},
        {"a": 1},
        {"a": a.finish_reason},
    )


class Samples:
    """The scripted executor, with every id it appends replaced by ``token``."""

    def __init__(self, m: Any, token: int) -> None:
        self.inner, self.token = m.LocalExecutor({}, {}), token

    def execute(self, plan: tuple[Any, ...]) -> tuple[Any, ...]:
        out = self.inner.execute(plan)
        return tuple(dataclasses.replace(o, token_ids=(self.token,) * len(o.token_ids)) for o in out)


def test_an_eos_id_ends_a_request_unless_it_ignores_eos(m: Any) -> None:
    # the executor samples 5, one of the engine's EOS ids, every time
    reqs = [m.Request("a", [1, 2, 3], 3), m.Request("b", [1, 2, 3], 3, ignore_eos=True)]
    eng = m.Engine(reqs, 8, 2, 16, executors=[Samples(m, 5)], eos_token_ids=[7, 5])
    first = eng.run()[0]
    assert first.sampled == {"a": m.Sample.EOS, "b": m.Sample.TOKEN} and first.finished == {"a": m.FinishReason.EOS}
    got = [(r.finish_reason, r.output_ids, r.generated) for r in reqs]
    assert got == [(m.FinishReason.EOS, [5], 0), (m.FinishReason.LENGTH, [5, 5, 5], 3)]
    # the scripted model's EOS id, 0, is an EOS id only with the built-in executor: with yours, a token
    assert m.Engine([], 8, 2, 16).eos_token_ids == {m.EOS_TOKEN_ID} == {0}
    c = m.Request("c", [1, 2, 3], 2)
    eng = m.Engine([c], 8, 2, 16, executors=[Samples(m, 0)])
    eng.run()
    assert (eng.eos_token_ids, c.finish_reason, c.output_ids) == (frozenset(), m.FinishReason.LENGTH, [0, 0])


class Windows:
    """The scripted executor, with every sampled id replaced by 9 and every decode window of three ids (two
    accepted guesses, then the sample) by ``window``."""

    def __init__(self, m: Any, window: tuple[int, int, int]) -> None:
        self.inner, self.window = m.LocalExecutor({}, {}), window

    def execute(self, plan: tuple[Any, ...]) -> tuple[Any, ...]:
        out = self.inner.execute(plan)
        ids = {1: (9,), 3: self.window}
        return tuple(dataclasses.replace(o, token_ids=ids.get(len(o.token_ids), o.token_ids)) for o in out)


def test_an_accepted_run_is_cut_at_an_eos_id_of_your_executor_unless_the_request_ignores_eos(m: Any) -> None:
    # spec_len 2: at step 1 each window accepts both guesses, [9, 5], and samples 9; 5 is an EOS id. a's run
    # is cut at it (one guess kept, 5 is a's sample: EOS); b ignores EOS and keeps both guesses and the sample
    reqs = [m.Request("a", [1, 2, 3], 8), m.Request("b", [1, 2, 3], 8, ignore_eos=True)]
    eng = m.Engine(reqs, 8, 4, 16, spec_len=2, executors=[Windows(m, (9, 5, 9))], eos_token_ids=[5])
    eng.step()
    t1 = eng.step()
    assert (t1.drafted, t1.accepted, t1.rolled_back) == ({"a": 2, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "b": 0})
    assert (t1.sampled, t1.finished) == ({"a": m.Sample.EOS, "b": m.Sample.TOKEN}, {"a": m.FinishReason.EOS})
    assert t1.tokens == {"a": (9, 5), "b": (9, 5, 9)}  # a's record ends at its EOS
    got = [(r.output_ids, r.generated, r.finish_reason) for r in reqs]
    assert got == [([9, 9, 5], 2, m.FinishReason.EOS), ([9, 9, 5, 9], 4, None)]


def test_the_record_says_how_each_sample_ended_and_the_summary_shows_unfinished_requests(m: Any) -> None:
    # the executor samples 5 every time: a stop id for s, an EOS id for e; t's eos_after 0 makes its first
    # sample EOS; u has nothing that ends it early
    reqs = [m.Request("s", [1, 2, 3], 3, stop_token_ids=(5,)), m.Request("e", [1, 2, 3], 3)]
    reqs += [m.Request("t", [1, 2, 3], 3, eos_after=0, ignore_eos=True), m.Request("u", [1, 2, 3], 3, ignore_eos=True)]
    eng = m.Engine(reqs, 16, 2, 16, executors=[Samples(m, 5)], eos_token_ids=[5])
    assert [entry["finish_reason"] for entry in eng.summary()] == [None] * 4
    first = eng.step()
    assert first.sampled == {"s": m.Sample.STOP, "e": m.Sample.EOS, "t": m.Sample.EOS, "u": m.Sample.TOKEN}
    assert [entry["finish_reason"] for entry in eng.summary()] == ["STOP", "EOS", "EOS", None]


Cut = tuple[Any, int]  # (when: the ids a request appended this step -> bool, how many of them to keep)


def run_with_stops(eng: Any, cuts: dict[str, Cut]) -> dict[str, tuple[Any, tuple[int, ...], Any]]:
    """Run ``eng`` to the end, stopping each request of ``cuts`` from outside the first time the ids it
    appends in a step satisfy ``when``, after ``keep`` of them; return, per request, the request, the ids
    it appended in that step and that step's record."""
    seen: dict[str, tuple[int, ...]] = {}
    out: dict[str, tuple[Any, tuple[int, ...], Any]] = {}

    def stop(rid: str, ids: tuple[int, ...]) -> int | None:
        if rid not in cuts or rid in seen or not cuts[rid][0](ids):
            return None
        seen[rid] = ids
        return int(cuts[rid][1])

    by_id = {r.request_id: r for r in eng.requests}
    while eng.live:
        assert eng.step_counter < 100, "did not stop"
        rec = eng.commit(eng.executor.execute(eng.schedule()), stop)
        eng.check_invariants()
        out |= {rid: (by_id[rid], ids, rec) for rid, ids in seen.items() if rid not in out}
    assert out.keys() == cuts.keys(), f"never stopped: {cuts.keys() - out.keys()}"
    return out


def test_a_stop_that_cuts_off_a_sampled_eos_takes_back_no_counted_token(m: Any) -> None:
    # a samples one token, then EOS (eos_after 1); the stop keeps none of [EOS]: one token stays counted
    eng = m.Engine([m.Request("a", [1, 2, 3], 8, eos_after=1)], 8, 4, 16)
    a, ids, rec = run_with_stops(eng, {"a": (lambda ids: ids[-1] == m.EOS_TOKEN_ID, 0)})["a"]
    assert ids == (m.EOS_TOKEN_ID,) and rec.finished == {"a": m.FinishReason.STOP}
    assert (a.generated, len(a.output_ids), a.finish_reason, a.computed) == (1, 1, m.FinishReason.STOP, 4)


@pytest.mark.parametrize("keep", [1, 2])
def test_a_stop_inside_a_window_that_ended_on_eos_keeps_every_kept_token_counted(m: Any, keep: int) -> None:
    # spec_len 2, eos_after 3: at step 1 a's window appends [g1, g2, EOS] (two accepted guesses, then the
    # sampled EOS) and b's [h1, h2, h3]; the stop keeps the first `keep` of each.  Every kept id is counted
    # (the EOS was not, and is gone), the window accepted only the kept guesses and rolled back the rest,
    # and neither request has computed a position past its last kept id.
    eng = m.Engine([m.Request("a", [1, 2, 3], 8, eos_after=3), m.Request("b", [4, 5, 6], 8)], 8, 4, 16, spec_len=2)
    cut = (lambda ids: len(ids) == 3, keep)
    got = run_with_stops(eng, {"a": cut, "b": cut})
    (a, a_ids, rec), (b, b_ids, b_rec) = got["a"], got["b"]
    assert rec is b_rec and rec.step == 1 and rec.finished == {"a": m.FinishReason.STOP, "b": m.FinishReason.STOP}
    assert a_ids[-1] == m.EOS_TOKEN_ID and m.EOS_TOKEN_ID not in a_ids[:-1] + b_ids
    for r, ids in ((a, a_ids), (b, b_ids)):
        kept = (r.generated, r.output_ids[1:], r.computed)
        assert kept == (1 + keep, list(ids[:keep]), 3 + 1 + keep), r.request_id  # t0, then the kept ids
        assert (rec.accepted[r.request_id], rec.rolled_back[r.request_id]) == (keep - 1, 3 - keep)


def test_a_stop_inside_a_forced_run_that_ended_on_a_stop_id_keeps_every_kept_token_counted() -> None:
    from mechserve.spec import m14_forced_runs as m

    # a samples t0 with its prefill; its grammar forces [7, 8, 9] after it, and 9 is a stop id: the run
    # ends a with STOP at 9 (t0, 7, 8 counted).  The stop from outside keeps t0 and 7.
    eng = m.Engine([m.Request("a", [1, 2, 3], 8, stop_token_ids=(9,), forced_script={0: (7, 8, 9)})], 8, 4, 16)
    a, ids, rec = run_with_stops(eng, {"a": (lambda ids: len(ids) == 4, 2)})["a"]
    assert ids[1:] == (7, 8, 9) and rec.forced == {"a": 1}
    assert (a.generated, a.output_ids, a.finish_reason) == (2, list(ids[:2]), m.FinishReason.STOP)
    assert a.computed == 3  # the prompt: the forced ids were never computed


@pytest.mark.parametrize(("keep", "forced", "accepted"), [(4, 1, 2), (2, 0, 1)])
def test_a_stop_inside_a_forced_run_after_a_decode_window_counts_only_the_forced_ids_it_kept(
    keep: int, forced: int, accepted: int
) -> None:
    from mechserve.spec import m14_forced_runs as m

    # spec_len 2: at step 1 a's window appends [g1, g2, s] (both guesses accepted; s has output index 3) and
    # its grammar forces [7, 8, 9] after s.  A stop keeping the window and one forced id: 1 forced id kept
    # (not the window's accepted guesses counted with it), the window's 2 still accepted.  One keeping g1, g2:
    # no forced id kept, g1 accepted (g2 ends the request), g2's acceptance rolled back.
    eng = m.Engine([m.Request("a", [1, 2, 3], 12, forced_script={3: (7, 8, 9)})], 8, 4, 16, spec_len=2)
    a, ids, rec = run_with_stops(eng, {"a": (lambda ids: len(ids) == 6, keep)})["a"]
    assert rec.step == 1 and ids[3:] == (7, 8, 9) and rec.tokens == {"a": ids[:keep]}
    assert (rec.forced, rec.accepted, rec.rolled_back) == ({"a": forced}, {"a": accepted}, {"a": 2 - accepted})
    assert (a.generated, a.output_ids[1:], a.finish_reason) == (1 + keep, list(ids[:keep]), m.FinishReason.STOP)


def corrupt(m: Any, how: str) -> Any:
    """An engine after one step (a: 9-token prompt, b: 5, pages of 2: each has published its complete prompt
    blocks and holds one private page), broken in one way."""
    eng = m.Engine([m.Request("a", list(range(1, 10)), 6), m.Request("b", [7] * 5, 6)], 16, 2, 16)
    eng.step()
    eng.check_invariants()  # whole before it is broken
    a, b = eng.requests
    a_private = next(p for p in a.page_table if eng.pool.owner[p] == "a")
    cached = next(p for p in a.page_table if eng.pool.owner[p] is m.CACHE)
    free = eng.pool.free[0]
    if how == "free twice":
        eng.pool.free.append(free)
    elif how == "cached twice":
        eng.cache.size += 1
    elif how == "owned but free":
        eng.pool.owner[free] = "b"
    elif how == "cached but not in the cache":
        eng.pool.owner[cached] = "a"
    elif how == "finished with pages":
        eng.abort("b")
        b.page_table = [free]
    elif how == "unbacked":
        b.computed += 2 * eng.pool.page_size
    elif how == "another's page":
        b.page_table.append(a_private)
    elif how == "private page twice":
        a.page_table.append(a_private)
    elif how == "private page in no table":
        eng.pool.free.remove(free)
        eng.pool.owner[free] = "a"
    else:
        raise AssertionError(how)
    return eng


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("free twice", "a page is on the free list twice"),
        ("cached twice", "a page is cached twice"),
        ("owned but free", r"page \d+: owner 'b' vs free list"),
        ("cached but not in the cache", r"page \d+: owner 'a' vs cache"),
        ("finished with pages", "b: ABORTED but holds pages"),
        ("unbacked", "b: unbacked positions"),
        ("another's page", r"b: page \d+ belongs to 'a'"),
        ("private page twice", r"private page \d+ is in two tables"),
        ("private page in no table", "a private page is in no owner's table"),
    ],
)
def test_check_invariants_names_each_kind_of_corruption(m: Any, how: str, message: str) -> None:
    # the invariant check is the property tests' oracle: each corruption must fail it, with its own message
    with pytest.raises(AssertionError, match=f"^{message}$"):
        corrupt(m, how).check_invariants()


# The contract's refusals, as the lower rungs' notes pin them (m07's cache, m10's boundary, m11's join, m12's
# stop), on the top rungs: the same code is copied into each rung's file, and only these tests see m13's and
# m14's copies.


def test_the_cache_refuses_a_bad_insert_or_removal_by_what_is_wrong(m: Any) -> None:
    k = m.prefix_keys([1, 2, 3, 4, 5, 6], 2)
    other = m.prefix_keys([9, 9, 3, 4], 2)
    cache = m.RadixCache()
    assert cache.insert(k, [10, 11, 12]) == 3 and cache.insert(k[:2], [10, 11]) == 0
    refusals = [
        (lambda: cache.insert(k, [10]), "insert: 3 keys but 1 blocks"),
        (lambda: cache.insert(k[1:], [11, 12]), "insert: keys are not a chain starting at ROOT"),
        (lambda: cache.insert([k[0], other[1]], [10, 11]), "insert: keys are not a chain starting at ROOT"),
        (lambda: cache.insert(k[:2], [10, 99]), "insert: key already holds block 11, not 99"),
        (lambda: cache.remove_leaf(other[1]), "remove_leaf: key is not in the cache"),
        (lambda: cache.remove_leaf(k[1]), "remove_leaf: node has children"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            call()
        assert (cache.size, cache.match(k), [key for key, _ in cache.leaves()]) == (3, [10, 11, 12], [k[2]])
    assert cache.remove_leaf(k[2]) == 12 and cache.remove_leaf(k[1]) == 11 and cache.size == 1


def test_join_refuses_wrong_ranks_world_sizes_and_any_disagreement_by_name(m: Any) -> None:
    res = (m.Outcome("a", 0, 2, 0, ((0, 0, 0), (1, 0, 1)), (7,)),)
    odd = (m.Outcome("a", 0, 2, 0, ((0, 0, 0), (1, 0, 1)), (8,)),)
    cases = [
        ([m.Report(0, 2, res), m.Report(0, 2, res)], "ranks [0, 0] are not 0..1"),
        ([m.Report(1, 2, res), m.Report(2, 2, res)], "ranks [1, 2] are not 0..1"),
        ([m.Report(0, 2, res), m.Report(1, 3, res)], "rank 1 reports world size 3, not 2"),
        ([m.Report(1, 2, odd), m.Report(0, 2, res)], "rank 1 disagrees with rank 0"),
    ]
    for reports, message in cases:
        with pytest.raises(m.GroupViolation, match=f"^{re.escape(message)}$"):
            m.join(reports, 2)
    assert m.join([m.Report(1, 2, res), m.Report(0, 2, res)], 2) is res


class Breaking:
    """The scripted executor, with its answer at call ``at`` rewritten by ``breaks``; records the engine's
    state right before it answers."""

    def __init__(self, m: Any, at: int, breaks: Any) -> None:
        self.inner, self.at, self.breaks, self.calls = m.LocalExecutor({}, {}), at, breaks, 0
        self.engine: Any = None
        self.before: Any = None

    def execute(self, plan: tuple[Any, ...]) -> tuple[Any, ...]:
        out = self.inner.execute(plan)
        if self.calls == self.at:
            self.before = state(self.engine)
            out = self.breaks(plan, out)
        self.calls += 1
        return out


def state(eng: Any) -> tuple[Any, ...]:
    reqs = [
        (r.request_id, r.state, r.computed, r.generated, list(r.output_ids), list(r.page_table)) for r in eng.requests
    ]
    return reqs, list(eng.pool.owner), list(eng.pool.free), eng.cache.size, eng.step_counter


def edit(out: tuple[Any, ...], i: int, **changes: Any) -> tuple[Any, ...]:
    return tuple(dataclasses.replace(o, **changes) if k == i else o for k, o in enumerate(out))


BREACHES = [
    # (step, budget, how the outcomes are broken, the refusal); a [1, 2, 3] and b [4, 5] prefill at step 0
    # (budget 8; budget 4 cuts b's prompt) and run decode windows of 1 + 2 at step 1
    (1, 8, lambda plan, out: out[:1], "1 outcome(s) for 2 plan item(s)"),
    (1, 8, lambda plan, out: edit(out, 0, request_id="b"), "outcome for 'b' where 'a' was planned"),
    (1, 8, lambda plan, out: edit(out, 0, start_position=4), "a: frontier mismatch (4 != 3)"),
    (1, 8, lambda plan, out: edit(out, 0, executed_tokens=2), "a: executed 2 token(s), planned 3"),
    (1, 8, lambda plan, out: edit(out, 0, writes=out[0].writes[:-1]), "a: writes differ from the planned placements"),
    (0, 8, lambda plan, out: edit(out, 0, accepted_draft_tokens=1), "a: acceptance reported for a non-decode item"),
    (1, 8, lambda plan, out: edit(out, 1, accepted_draft_tokens=3), "b: acceptance 3 outside [0, 2]"),
    (1, 8, lambda plan, out: edit(out, 1, accepted_draft_tokens=-1), "b: acceptance -1 outside [0, 2]"),
    (1, 8, lambda plan, out: edit(out, 0, token_ids=(*out[0].token_ids, 5)), "a: 4 token id(s) appended, expected 3"),
    (0, 4, lambda plan, out: edit(out, 1, token_ids=(5,)), "b: 1 token id(s) appended, expected 0"),
]


@pytest.mark.parametrize(("step", "budget", "breaks", "message"), BREACHES)
def test_a_broken_outcome_is_refused_by_name_and_applies_nothing(
    m: Any, step: int, budget: int, breaks: Any, message: str
) -> None:
    executor = Breaking(m, step, breaks)
    eng = m.Engine(
        [m.Request("a", [1, 2, 3], 5), m.Request("b", [4, 5], 5)], budget, 2, 8, spec_len=2, executors=[executor]
    )
    executor.engine = eng
    for _ in range(step):
        eng.step()
    with pytest.raises(m.BoundaryViolation, match=f"^{re.escape(message)}$"):
        eng.step()
    assert state(eng) == executor.before and eng.step_counter == step
    with pytest.raises(RuntimeError, match=r"^commit\(\) without an open step: call schedule\(\) first$"):
        eng.commit(())  # the failed step was closed


def test_forced_ids_on_an_item_that_does_not_sample_are_refused_by_name() -> None:
    from mechserve.spec import m14_forced_runs as m

    # budget 4: b's prompt is cut at step 0, so b's item does not sample
    executor = Breaking(m, 0, lambda plan, out: edit(out, 1, forced=(7, 8)))
    eng = m.Engine([m.Request("a", [1, 2, 3], 5), m.Request("b", [4, 5], 5)], 4, 2, 8, executors=[executor])
    executor.engine = eng
    with pytest.raises(m.BoundaryViolation, match=r"^b: 2 forced id\(s\) on an item that does not sample$"):
        eng.step()
    assert state(eng) == executor.before and eng.step_counter == 0


def test_commit_needs_an_open_step_and_resolve_its_verdicts(m: Any) -> None:
    eng = m.Engine([m.Request("a", [1, 2, 3], 5)], 8, 2, 8)
    message = r"^commit\(\) without an open step: call schedule\(\) first$"
    with pytest.raises(RuntimeError, match=message):
        eng.commit(())
    plan = eng.schedule()
    eng.commit(eng.executor.execute(plan))
    with pytest.raises(RuntimeError, match=message):
        eng.commit(eng.executor.execute(plan))  # twice
    a = eng.requests[0]
    for verdicts in (None, {}):
        with pytest.raises(m.BoundaryViolation, match=r"^resolve called without verdicts$"):
            eng._resolve([(a, 1)], verdicts)


@pytest.mark.parametrize("keep", [-1, 2])
def test_a_stop_keeping_more_than_was_appended_or_less_than_none_is_refused(m: Any, keep: int) -> None:
    eng = m.Engine([m.Request("a", [1, 2, 3], 5)], 8, 2, 8)
    message = f"a: a stop may keep 0..1 of the ids it appended, not {keep}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        eng.commit(eng.executor.execute(eng.schedule()), lambda rid, ids: keep)


@pytest.mark.parametrize("rung", ["m15_routing", "m16_request_draft_lengths"])
def test_a_request_keeps_the_keys_and_hashes_it_brings_only_when_they_name_its_own_blocks(rung: str) -> None:
    # m15's add_request: a routed request brings the prompt keys and block hashes the router computed (the
    # router must hear its own names back in the KV events); keys of another namespace or another page size,
    # or hashes of another count (a prefix of the chain, or none), are made again here from the engine's
    # hash seed. Pages of 2; prompts of one and of three blocks.
    m = importlib.import_module(f"mechserve.spec.{rung}")
    other_root = m.hash_root("another seed")
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7]):
        own_keys = m.prefix_keys(tokens, 2, "engine")
        cases = [
            # (keys, hashes) carried -> (keys, hashes) the engine uses
            ((own_keys, m.block_hashes(tokens, 2, other_root)), (own_keys, m.block_hashes(tokens, 2, other_root))),
            ((m.prefix_keys(tokens, 2, "tenant-b"), []), (own_keys, None)),
            ((m.prefix_keys(tokens, 4, "engine"), m.block_hashes(tokens, 4, other_root)), (own_keys, None)),
            ((own_keys, m.block_hashes(tokens, 2, other_root)[:-1]), (own_keys, None)),
            (([], []), (own_keys, None)),
        ]
        for (keys, hashes), (want_keys, want_hashes) in cases:
            eng = m.Engine([], 8, 2, 16)
            r = m.Request("a", tokens, 1)
            r.prompt_keys, r.block_hashes = list(keys), list(hashes)
            assert eng.add_request(r) is None
            stored = [h for rec in eng.run() for e in rec.kv_events for h in e.block_hashes]
            assert r.prompt_keys == want_keys and {k.namespace for k in r.prompt_keys} == {"engine"}
            assert stored == (want_hashes or m.block_hashes(tokens, 2, eng.hash_root)), (tokens, keys, hashes)
            assert eng.cache.match(own_keys) != []
