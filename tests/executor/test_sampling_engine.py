"""Sampling through the m12 engine on the torch executor: greedy equivalents, seeds (BC24), min_tokens, logprobs,
stop ids inside an accepted run (BC16) and mixed zero/non-zero drafts (BC22)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_checkpoints import VOCAB, Tiny, hf_greedy, random_prompts

import mechserve.executor.torch_executor as torch_executor
from mechserve.api.outputs import TokenLogprobs
from mechserve.api.params import SamplingParams
from mechserve.executor.proposers import propose_ngram
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Sampler
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.spec import m16_request_draft_lengths as m16


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0


@dataclass
class Run:
    outputs: dict[str, list[int]]
    finish: dict[str, str | None]
    records: list[m16.StepRecord]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


Proposer = Callable[[Sequence[int], int], Sequence[int]]


def run(
    tiny: Tiny,
    reqs: Sequence[Req],
    *,
    eos: tuple[int, ...] = (),
    spec_len: int = 0,
    budget: int = 64,
    page_size: int = 4,
    num_pages: int = 64,
    proposer: Proposer | None = None,
    sampler_seed: int | None = None,
) -> Run:
    """Run ``reqs`` through the m12 engine on one TorchExecutor; collect each step's kept logprobs."""
    ex = TorchExecutor(tiny.model, num_pages, page_size, sampler=Sampler(seed=sampler_seed), proposer=proposer)
    requests = []
    for r in reqs:
        ex.add_request(ExecutorRequest(r.rid, r.prompt, r.params, eos))
        requests.append(
            m16.Request(
                r.rid,
                list(r.prompt),
                r.params.max_tokens,
                arrival_step=r.arrival,
                stop_token_ids=r.params.stop_token_ids,
                ignore_eos=r.params.ignore_eos,
            )
        )
    engine = m16.Engine(requests, budget, page_size, num_pages, spec_len=spec_len, executors=[ex], eos_token_ids=eos)
    logprobs: dict[str, list[TokenLogprobs]] = {r.rid: [] for r in reqs}

    def on_step(record: m16.StepRecord) -> None:
        for r in reqs:
            got, kept = ex.take_logprobs(r.rid), record.tokens.get(r.rid, ())
            if r.params.logprobs is None:
                assert got == []
            else:
                assert len(got) >= len(kept) and [lp.token_id for lp in got[: len(kept)]] == list(kept)
                logprobs[r.rid] += got[: len(kept)]
        for rid in record.finished:
            ex.release(rid)

    records = engine.run(on_step)
    assert all(r.state is m16.RequestState.FINISHED for r in requests)
    outputs = {r.request_id: list(r.output_ids) for r in requests}
    finish = {r.request_id: r.finish_reason.value if r.finish_reason else None for r in requests}
    return Run(outputs, finish, records, logprobs)


def oracle(continuations: dict[tuple[int, ...], Sequence[int]]) -> Proposer:
    """A drafter that knows the continuation of each prompt (prompt lookup for any other request)."""

    def propose(history: Sequence[int], num: int) -> Sequence[int]:
        for prompt, cont in continuations.items():
            if tuple(history[: len(prompt)]) == prompt:
                k = len(history) - len(prompt)  # outputs already known, the last sampled one included
                return list(cont[k : k + num])
        return propose_ngram(history, num)

    return propose


def accepted(records: Sequence[m16.StepRecord], rid: str) -> int:
    return sum(r.accepted.get(rid, 0) for r in records)


# Greedy equivalents -------------------------------------------------------------------------------------------------

GREEDY_EQUIVALENTS = {
    "temperature-0": SamplingParams(temperature=0.0, max_tokens=8),
    "top_k-1": SamplingParams(temperature=1.0, top_k=1, max_tokens=8),
    "top_p-tiny": SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8),
    "min_p-1": SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8),
}


@pytest.mark.parametrize("spec_len", [0, 2])
@pytest.mark.parametrize("name", list(GREEDY_EQUIVALENTS))
def test_greedy_equivalents_match_transformers(tiny: Tiny, name: str, spec_len: int) -> None:
    prompts = random_prompts([5, 9, 3], seed=31)
    reqs = [Req(f"r{i}", p, GREEDY_EQUIVALENTS[name]) for i, p in enumerate(prompts)]
    out = run(tiny, reqs, spec_len=spec_len, budget=16)
    for r in reqs:
        assert out.outputs[r.rid] == hf_greedy(tiny.hf, r.prompt, 8), name


# BC24 and its kind: a seeded request's tokens depend on (seed, token index) alone -----------------------------------

X, Y = random_prompts([6, 5], seed=24)
SEEDED = SamplingParams(temperature=0.8, top_p=1.0, seed=42, max_tokens=16, ignore_eos=True)
UNSEEDED = replace(SEEDED, seed=None)


def test_bc24_seeded_request_is_reproducible_whatever_its_batchmates(tiny: Tiny) -> None:
    """A (seed 42) and B (unseeded), temperature 0.8: A's 16 tokens are the same in every run and batch."""
    eos = (int(hf_greedy(tiny.hf, X, 1)[0]),)  # an EOS id A would meet early; ignore_eos makes it ordinary
    a, b = Req("A", X, SEEDED), Req("B", Y, UNSEEDED)
    batched = [run(tiny, [a, b], eos=eos) for _ in range(4)]
    alone = run(tiny, [a], eos=eos)
    b_seeded = run(tiny, [a, Req("B", Y, replace(UNSEEDED, seed=7))], eos=eos)
    late = run(tiny, [replace(a, arrival=6), b], eos=eos)
    assert late.records[6].admitted == ("A",) and late.records[5].sampled.get("B") is m16.Sample.TOKEN
    want = alone.outputs["A"]
    assert len(want) == 16
    for r in [*batched, b_seeded, late]:
        assert r.outputs["A"] == want
    # the control: the seed matters, and the unseeded B really is random
    assert run(tiny, [Req("A", X, replace(SEEDED, seed=43))], eos=eos).outputs["A"] != want
    assert len({tuple(r.outputs["B"]) for r in batched}) > 1


_REFERENCE: dict[SamplingParams, list[int]] = {}


def reference_a(tiny: Tiny, params: SamplingParams) -> list[int]:
    """A alone: one request, ample budget and pool, no speculation."""
    if params not in _REFERENCE:
        _REFERENCE[params] = run(tiny, [Req("A", X, params)]).outputs["A"]
    return _REFERENCE[params]


other_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    seed=st.one_of(st.none(), st.integers(0, 100)),
    max_tokens=st.integers(1, 12),
    ignore_eos=st.just(True),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    a_params=st.sampled_from(
        [SEEDED, replace(SEEDED, top_k=7, top_p=0.9, min_p=0.05, seed=5), replace(SEEDED, temperature=1.5, seed=-3)]
    ),
    others=st.lists(st.tuples(st.integers(2, 10), other_params, st.integers(0, 8)), max_size=3),
    a_arrival=st.integers(0, 6),
    a_at=st.integers(0, 3),
    budget=st.sampled_from([3, 7, 16, 64]),
    page_size=st.sampled_from([2, 4, 8]),
    spare_pages=st.sampled_from([0, 2, 64]),
    speculation=st.sampled_from([(3, "oracle"), (3, "ngram"), (0, "none")]),
)
def test_seeded_output_is_invariant_to_the_configuration(
    tiny: Tiny,
    a_params: SamplingParams,
    others: list[tuple[int, SamplingParams, int]],
    a_arrival: int,
    a_at: int,
    budget: int,
    page_size: int,
    spare_pages: int,
    speculation: tuple[int, str],
) -> None:
    """Budget, page size, a tight pool (preemption), spec_len 0 or 3, drafts accepted or not, any batchmates."""
    spec_len, drafter = speculation
    want = reference_a(tiny, a_params)
    prompts = random_prompts([n for n, _, _ in others], seed=len(others) + budget)
    reqs = [Req(f"o{i}", p, params, arrival) for i, (p, (_, params, arrival)) in enumerate(zip(prompts, others))]
    reqs.insert(min(a_at, len(reqs)), Req("A", X, a_params, a_arrival))  # later in the list = a likelier victim
    need = max(m16.pages_for(len(r.prompt) + r.params.max_tokens, page_size) for r in reqs)
    proposer = oracle({tuple(X): want}) if drafter == "oracle" else None
    got = run(
        tiny,
        reqs,
        spec_len=spec_len,
        budget=budget,
        page_size=page_size,
        num_pages=need + spare_pages,
        proposer=proposer,
    )
    event(f"A preempted: {any('A' in r.preempted for r in got.records)}")
    event(f"A accepted drafts: {accepted(got.records, 'A') > 0}")
    assert got.outputs["A"] == want


def test_seeded_output_survives_preemption_and_accepted_drafts(tiny: Tiny) -> None:
    """One configuration of the property above that certainly preempts A and accepts its drafts."""
    want = reference_a(tiny, SEEDED)
    others = [Req(f"o{i}", p, replace(UNSEEDED, max_tokens=14)) for i, p in enumerate(random_prompts([9, 7], seed=5))]
    got = run(
        tiny,
        [*others, Req("A", X, SEEDED, arrival=1)],  # the last running request is the victim
        spec_len=3,
        budget=12,
        page_size=2,
        num_pages=13,
        proposer=oracle({tuple(X): want}),
    )
    assert any("A" in r.preempted for r in got.records)
    assert accepted(got.records, "A") >= 6
    assert got.outputs["A"] == want


# min_tokens ---------------------------------------------------------------------------------------------------------


def hf_min_tokens(tiny: Tiny, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> tuple[list[int], str]:
    """transformers' greedy continuation with the ends masked below min_tokens, and its finish reason."""
    stops = set(params.stop_token_ids)
    ends = stops | (set() if params.ignore_eos else set(eos))
    out: list[int] = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = tiny.hf(torch.tensor([prompt + out])).logits[0, -1]
        if len(out) < params.min_tokens:
            logits[list(ends)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in ends:
            return out, "STOP" if out[-1] in stops else "EOS"
    return out, "LENGTH"


@pytest.mark.parametrize("spec_len", [0, 2])
@pytest.mark.parametrize("case", ["eos", "stop", "ignore_eos"])
def test_min_tokens_masks_eos_and_stop_ids(tiny: Tiny, case: str, spec_len: int) -> None:
    """EOS (unless ignore_eos) and stop ids are never chosen while the output is shorter than min_tokens."""
    prompt = random_prompts([6], seed=11)[0]
    first = hf_greedy(tiny.hf, prompt, 1)[0]  # without min_tokens the request would end at once
    base = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3)
    eos: tuple[int, ...] = (first,)
    if case == "stop":
        params, eos = replace(base, stop_token_ids=(first,)), ()
    elif case == "ignore_eos":
        params = replace(base, ignore_eos=True, stop_token_ids=((first + 1) % VOCAB,))
    else:
        params = base
    want, reason = hf_min_tokens(tiny, prompt, params, eos)
    proposer = oracle({tuple(prompt): want})  # drafts that cross the min_tokens boundary inside one window
    got = run(tiny, [Req("a", prompt, params)], eos=eos, spec_len=spec_len, proposer=proposer)
    assert got.outputs["a"] == want and got.finish["a"] == reason
    if case == "ignore_eos":
        assert want[0] == first  # EOS is an ordinary token, so it is not masked
    else:
        assert first not in want[:3]
        early = run(tiny, [Req("a", prompt, replace(params, min_tokens=0))], eos=eos)
        assert early.outputs["a"] == [first]
    if spec_len:
        assert accepted(got.records, "a") > 0


def test_min_tokens_bans_hold_when_sampling(tiny: Tiny) -> None:
    prompt = random_prompts([6], seed=11)[0]
    eos = tuple(hf_greedy(tiny.hf, prompt, 1))
    stop = (eos[0] + 1) % VOCAB
    params = SamplingParams(temperature=1.5, min_tokens=4, max_tokens=6, stop_token_ids=(stop,))
    reqs = [Req(f"r{s}", prompt, replace(params, seed=s)) for s in range(12)]
    got = run(tiny, reqs, eos=eos)
    for r in reqs:
        assert not {eos[0], stop} & set(got.outputs[r.rid][:4])


# logprobs -----------------------------------------------------------------------------------------------------------


def hf_logprobs(tiny: Tiny, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] float64 log_softmax of transformers' logits at the positions that chose ``output``."""
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].double(), dim=-1)


def test_logprobs_match_transformers(tiny: Tiny) -> None:
    """Raw logprobs of every kept id (sampled and accepted guesses), under chunked prefill and speculation."""
    pa, pb, pc = random_prompts([11, 6, 4], seed=8)
    a = Req("a", pa, SamplingParams(temperature=0.9, seed=3, logprobs=5, max_tokens=12))
    b = Req("b", pb, SamplingParams(temperature=0.0, max_tokens=12))
    c = Req("c", pc, SamplingParams(temperature=1.0, seed=4, logprobs=0, max_tokens=5))
    first = run(tiny, [a, b, c])
    got = run(tiny, [a, b, c], spec_len=3, budget=5, proposer=oracle({tuple(pa): first.outputs["a"]}))
    assert got.outputs["a"] == first.outputs["a"] and accepted(got.records, "a") > 0
    assert got.logprobs["b"] == []
    for r in (a, c):
        out, lps = got.outputs[r.rid], got.logprobs[r.rid]
        ref = hf_logprobs(tiny, r.prompt, out)
        n = r.params.logprobs
        assert n is not None and [lp.token_id for lp in lps] == out
        for row, lp in zip(ref, lps):
            assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
            lower = 1 + int((row > row[lp.token_id] + 1e-4).sum())
            assert lower <= lp.rank <= int((row >= row[lp.token_id] - 1e-4).sum())
            assert len(lp.top_ids) == n and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            top = row.topk(n)
            assert torch.allclose(torch.tensor(lp.top_logprobs, dtype=torch.float64), top.values, atol=1e-4)
            assert all(abs(float(row[t]) - v) < 1e-4 for t, v in zip(lp.top_ids, lp.top_logprobs))
            assert lp.token_id in lp.to_dict()


def test_no_logprobs_cost_nothing(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a request that asks, the executor never computes logprobs and records nothing."""

    def forbidden(*args: object) -> None:
        raise AssertionError("logprobs computed for requests that did not ask")

    monkeypatch.setattr(torch_executor, "token_logprobs", forbidden)
    prompts = random_prompts([5, 7], seed=2)
    reqs = [Req("g", prompts[0], SamplingParams(temperature=0.0)), Req("s", prompts[1], SamplingParams(seed=1))]
    got = run(tiny, reqs, spec_len=2)
    assert got.logprobs == {"g": [], "s": []}


# BC16: a stop id inside an accepted run ---------------------------------------------------------------------------


def bc16_setup(tiny: Tiny, params: SamplingParams) -> tuple[list[int], list[int]]:
    """A prompt whose 8-token continuation has a fresh id at index 2 and another at index 6."""
    for seed in range(100):
        prompt = random_prompts([5], seed=100 + seed)[0]
        cont = run(tiny, [Req("r", prompt, replace(params, max_tokens=8))]).outputs["r"]
        if cont[2] not in cont[:2] and cont[6] not in cont[:6]:
            return prompt, cont
    raise AssertionError("no suitable prompt")


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=16)],
    ids=["greedy", "seeded"],
)
def test_bc16_stop_id_inside_an_accepted_run_finishes_with_stop(tiny: Tiny, params: SamplingParams) -> None:
    """The drafter proposes the true continuation: one window accepts [c1, STOP, c3, c4]; nothing after STOP stays."""
    prompt, cont = bc16_setup(tiny, params)
    rigged = oracle({tuple(prompt): cont})
    capped = replace(params, max_tokens=5, logprobs=2)
    stop = run(tiny, [Req("r", prompt, replace(capped, stop_token_ids=(cont[2],)))], spec_len=5, proposer=rigged)
    assert stop.outputs["r"] == cont[:3] and stop.finish["r"] == "STOP"
    window = next(r for r in stop.records if r.drafted.get("r"))
    assert window.drafted["r"] == 3 and window.accepted["r"] == 1 and window.rolled_back["r"] == 2
    assert window.tokens["r"] == (cont[1], cont[2])  # the executor accepted all 3 guesses; the run was cut at STOP
    assert any("accepted 3 of 3" in line for line in window.explain)
    assert [lp.token_id for lp in stop.logprobs["r"]] == cont[:3]
    # the sibling: an EOS id inside the accepted run wins over the cap as well
    eos = run(tiny, [Req("r", prompt, capped)], eos=(cont[2],), spec_len=5, proposer=rigged)
    assert eos.outputs["r"] == cont[:3] and eos.finish["r"] == "EOS"
    # the control: a stop id at index >= max_tokens is never reached
    late = run(tiny, [Req("r", prompt, replace(capped, stop_token_ids=(cont[6],)))], spec_len=5, proposer=rigged)
    assert late.outputs["r"] == cont[:5] and late.finish["r"] == "LENGTH"


# BC22: zero drafts next to two drafts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=22)],
    ids=["greedy", "seeded"],
)
def test_bc22_zero_and_two_drafts_in_one_batch_match_each_alone(tiny: Tiny, params: SamplingParams) -> None:
    """A (3 tokens) drafts 0 at its last step while B (10 tokens) drafts 2; B's proposer once returns []."""
    pa, pb = random_prompts([4, 4], seed=22)
    a, b = Req("A", pa, replace(params, max_tokens=3)), Req("B", pb, replace(params, max_tokens=10, seed=23))
    b_alone = run(tiny, [b]).outputs["B"]
    rigged = oracle({tuple(pb): b_alone})

    def sometimes_empty(history: Sequence[int], num: int) -> Sequence[int]:
        return [] if len(history) == len(pb) + 4 else rigged(history, num)

    alone_a = run(tiny, [a], spec_len=2, proposer=sometimes_empty).outputs["A"]
    both = run(tiny, [a, b], spec_len=2, proposer=sometimes_empty)
    assert len(both.outputs["A"]) == 3 and len(both.outputs["B"]) == 10
    assert both.outputs["A"] == alone_a == run(tiny, [a]).outputs["A"]
    assert both.outputs["B"] == b_alone
    assert any(r.drafted.get("A") == 0 and r.drafted.get("B") == 2 for r in both.records)
    # prompt lookup rarely guesses right here, so B ends with steps where every window has 0 drafts
    plain = run(tiny, [b], spec_len=2)
    assert plain.outputs["B"] == b_alone
    tail = [r for r in plain.records if r.drafted and not any(r.drafted.values())]
    assert tail and all(len(r.tokens[rid]) == 1 for r in tail for rid in r.drafted)
