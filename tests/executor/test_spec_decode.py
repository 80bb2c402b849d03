"""Speculative decoding on real tensors (tiny models): prompt lookup and a draft model, exact greedy verification.

Greedy output with speculation equals the output without it, for both proposers, at batch 1 and in
batch mixes, under chunked prefill, prefix reuse and preemption; the draft model's paged KV stays
what a dense forward computes; stop ids, EOS and stop strings inside an accepted run cut it (BC16, with
every proposer, an EAGLE head included), windows with and without drafts share a step (BC22); the conformance checks (replay, contract, KV audit) pass
with both proposers; the adaptive spec_len and the configuration surface (SpeculativeConfig,
EngineConfig, LLM, ``mechserve generate``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import run_engine as generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_checkpoints import Tiny, random_prompts, tiny_config
from tiny_engines import eagle_spec, greedy_sequences, train_tiny_head
from tiny_models import save_cycle_model

from mechserve.api.config import EngineConfig, SpeculativeConfig, parse_draft_model
from mechserve.api.params import SamplingParams
from mechserve.cli.main import main
from mechserve.engine.core import EngineCore
from mechserve.executor.governor import Candidate, Governor
from mechserve.executor.proposers import DraftModelProposer, NgramIndex, NgramProposer, Window, lookup_ngram
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model.llama import LlamaModel
from mechserve.model.loader import LoadedModel, load_model
from mechserve.spec import m16_request_draft_lengths as m16

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False)
MODEL_FREE = {"ngram": NGRAM, "suffix": SUFFIX}


def draft_spec(k: int = 3, adaptive: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", num_speculative_tokens=k, draft_model="tiny:layers=1", adaptive=adaptive)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny models gain nothing from two, and two spin against a busy neighbour."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Run:
    outputs: dict[str, list[int]]
    finish: dict[str, str | None]
    records: list[m16.StepRecord]
    executor: TorchExecutor


def run(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    max_new: int | Sequence[int],
    *,
    spec: SpeculativeConfig | None = None,
    draft: LlamaModel | None = None,
    budget: int = 64,
    page_size: int = 4,
    num_pages: int = 96,
    arrivals: Sequence[int] | None = None,
    eos: tuple[int, ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    params: SamplingParams | None = None,
    on_step: Any = None,
) -> Run:
    """``prompts`` through the m12 engine on one ``TorchExecutor`` (spec_len from ``spec``, 0 without)."""
    ex = TorchExecutor(model, num_pages, page_size, speculative=spec, draft_model=draft)
    news = [max_new] * len(prompts) if isinstance(max_new, int) else list(max_new)
    arrivals = arrivals or [0] * len(prompts)
    requests = []
    for i, (p, n, a) in enumerate(zip(prompts, news, arrivals)):
        ex.add_request(ExecutorRequest(f"r{i}", p, params or SamplingParams(temperature=0.0, max_tokens=n), eos))
        requests.append(m16.Request(f"r{i}", list(p), n, arrival_step=a, stop_token_ids=stop_token_ids))
    spec_len = spec.num_speculative_tokens if spec else 0
    engine = m16.Engine(requests, budget, page_size, num_pages, spec_len=spec_len, executors=[ex], eos_token_ids=eos)

    def step_done(record: m16.StepRecord) -> None:
        engine.check_invariants()
        if on_step is not None:
            on_step(engine, ex, record)
        ex.settle(record.accepted)  # as EngineCore does: the executor counts what the requests kept
        for rid in record.finished:
            ex.release(rid)

    records = engine.run(step_done)
    return Run(
        {r.request_id: list(r.output_ids) for r in requests},
        {r.request_id: r.finish_reason.value if r.finish_reason else None for r in requests},
        records,
        ex,
    )


def total(records: Sequence[m16.StepRecord], name: str) -> int:
    return sum(sum(getattr(rec, name).values()) for rec in records)


def copy_heavy(seed: int) -> list[int]:
    """A prompt that repeats a random segment: prompt lookup finds matches in it."""
    (seg,) = random_prompts([7], seed=seed)
    return [*seg, *seg, *seg[:3]]


PROMPTS = [*random_prompts([5, 12, 3, 17, 9, 6], seed=41), copy_heavy(1), copy_heavy(2)]


# Prompt lookup ------------------------------------------------------------------------------------------------------


def test_lookup_ngram_takes_the_longest_suffix_then_the_earliest_match() -> None:
    assert lookup_ngram([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert lookup_ngram([5, 6, 7, 5, 6, 8, 5, 6], 2) == [7, 5]  # the earliest occurrence of [5, 6]
    assert lookup_ngram([4, 1, 7, 1, 2, 3, 1], 2) == [7, 1]  # [3, 1] has no match; [1] first at 1
    assert lookup_ngram([4, 1, 7, 1, 2, 3, 1], 2, min_n=2) == []  # n = 1 is below min_n
    assert lookup_ngram([1, 2, 3], 2) == []  # no match: nothing, not padding
    assert lookup_ngram([1, 2, 1], 4) == [2, 1]  # fewer than asked at the end of the history
    assert lookup_ngram([-1, 4, -1, 5, 4], 3) == []  # an unknown follower is never proposed
    assert lookup_ngram([4, 6, -1, 4], 3) == [6]  # ... and ends a proposal
    assert lookup_ngram([8, 9, 8, 9, 8], 2, max_n=1) == [9, 8]  # n = 1 only: first 8 at 0
    assert lookup_ngram([7], 3) == [] and lookup_ngram([7, 7], 0) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(-1, 5), max_size=12), min_size=1, max_size=6),
    st.lists(st.integers(0, 30), min_size=6, max_size=6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(0, 5),
)
def test_the_ngram_index_answers_what_lookup_ngram_answers_as_the_history_grows_and_is_cut(
    pieces: list[list[int]], cuts: list[int], min_n: int, extra: int, num: int
) -> None:
    """Prompt lookup's incremental index (``NgramIndex``) against the scan it replaces, over a history that
    grows by pieces and is cut back between them (a rollback, a recompute), with unknown ids (-1) in it."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    history: list[int] = []
    for piece, cut in zip(pieces, cuts):
        history = history[: max(0, len(history) - cut)] + piece
        for end in range(len(history) - len(piece), len(history) + 1):
            index.sync(history[:end])
            assert index.lookup(num) == lookup_ngram(history[:end], num, min_n, max_n), (history[:end], num)


def test_prompt_lookup_keeps_one_index_per_request_until_its_release() -> None:
    proposer = NgramProposer(1, 3)
    a = ExecutorRequest("a", (1, 2, 3, 1, 2))
    assert proposer.available(a, [1, 2, 3, 1, 2], 2) == 2  # [1, 2] first at 0: 3, 1 follow
    assert proposer.available(a, [1, 2, 3, 1, 2, 3], 5) == 3  # [1, 2, 3] at 0: only 1, 2, 3 follow
    assert proposer.available(a, [1, 2, 9], 3) == 0  # cut back and regrown: [9] never seen
    proposer.release(a, [9])
    assert proposer._index == {}


# Greedy equality ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny: Tiny) -> dict[str, list[int]]:
    return run(tiny.model, PROMPTS, 16).outputs


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft-1-layer", "draft-full"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(budget=64, page_size=4),
        dict(budget=7, page_size=2, arrivals=[0, 0, 1, 1, 2, 3, 3, 5]),
        dict(budget=20, page_size=1, num_pages=400),
    ],
    ids=["batch-8", "chunked-staggered", "page-size-1"],
)
def test_greedy_output_equals_plain_decoding(
    tiny: Tiny, plain: dict[str, list[int]], proposer: str, shape: dict[str, Any]
) -> None:
    spec, draft = MODEL_FREE.get(proposer), None
    if spec is None:
        layers = 1 if proposer == "draft-1-layer" else tiny.model.arch.num_layers
        spec, draft = draft_spec(), tiny.model.truncated(layers)
    got = run(tiny.model, PROMPTS, 16, spec=spec, draft=draft, **shape)
    assert got.outputs == plain
    assert total(got.records, "drafted") > 0
    if proposer == "draft-full":  # a draft equal to the target: every guess is accepted
        assert got.executor.stats().accepted == got.executor.stats().proposed > 0
        assert total(got.records, "accepted") == total(got.records, "drafted")


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
def test_batch_one_equals_plain_decoding(tiny: Tiny, plain: dict[str, list[int]], proposer: str) -> None:
    spec, draft = (MODEL_FREE[proposer], None) if proposer in MODEL_FREE else (draft_spec(4), tiny.model.truncated(1))
    for i, p in enumerate(PROMPTS):
        assert run(tiny.model, [p], 16, spec=spec, draft=draft).outputs["r0"] == plain[f"r{i}"]


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
def test_preemption_mid_speculation_gives_the_same_output(
    tiny: Tiny, plain: dict[str, list[int]], proposer: str
) -> None:
    """A pool that cannot hold every request: speculating requests are preempted and recomputed."""
    spec, draft = (MODEL_FREE[proposer], None) if proposer in MODEL_FREE else (draft_spec(), tiny.model)
    need = max(m16.pages_for(len(p) + 16, 2) for p in PROMPTS)
    got = run(tiny.model, PROMPTS, 16, spec=spec, draft=draft, page_size=2, num_pages=need + 6, budget=24)
    assert got.outputs == plain
    assert any(rec.preempted for rec in got.records)
    # a preempted request's drafts are gone: it comes back as a re-prefill with no guesses, and drafts again
    # only after its first step back (the re-prefill's sample)
    resumed = 0
    for i, rec in enumerate(got.records):
        for rid in rec.preempted:
            back = next(r for r in got.records[i + 1 :] if rid in r.executed)
            assert rid not in back.drafted and rid not in back.accepted and rid not in back.rolled_back
            resumed += 1
    assert resumed > 0
    assert total(got.records, "rolled_back") > 0 or proposer == "draft"
    assert total(got.records, "accepted") > 0


# The draft model's KV --------------------------------------------------------------------------------------------


def dense_kv(model: LlamaModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``model`` over ``ids`` in one fresh contiguous forward: [layers, len(ids), KV, D]."""
    ex = TorchExecutor(model, m16.pages_for(len(ids), 4), 4)
    n = len(ids)
    table = tuple(range(m16.pages_for(n, 4)))
    item = m16.PlanItem("d", 0, n, 0, False, tuple((p, p // 4, p % 4) for p in range(n)), tuple(ids), True, 0, table)
    ex.execute((item,))
    k, v = ex.cache.k, ex.cache.v
    return k.reshape(k.shape[0], -1, *k.shape[3:])[:, :n], v.reshape(v.shape[0], -1, *v.shape[3:])[:, :n]


def dense_greedy(model: LlamaModel, ids: Sequence[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        ex = TorchExecutor(model, m16.pages_for(len(out), 4), 4)
        table = tuple(range(m16.pages_for(len(out), 4)))
        placements = tuple((p, p // 4, p % 4) for p in range(len(out)))
        (o,) = ex.execute((m16.PlanItem("d", 0, len(out), 0, False, placements, tuple(out), True, 0, table),))
        out.append(o.token_ids[0])
    return out[len(ids) :]


def test_draft_kv_and_proposals_match_a_dense_draft_after_reuse_rollback_and_preemption(tiny: Tiny) -> None:
    """After every step, the draft KV of each running request (positions the draft has made valid)
    equals a dense draft forward over its ids; every guess the draft made is the dense draft's greedy choice."""
    (stem,) = random_prompts([9], seed=77)
    prompts = [stem + t for t in random_prompts([3, 2, 5, 1], seed=78)]
    draft = tiny.model.truncated(1)
    checked = {"kv": 0, "proposals": 0}
    proposals: list[tuple[list[int], tuple[int, ...]]] = []

    def on_step(engine: m16.Engine, ex: TorchExecutor, record: m16.StepRecord) -> None:
        proposer = ex.proposer
        assert isinstance(proposer, DraftModelProposer)
        cache, ps = proposer.cache, 2
        for r in engine.running:
            valid = min(proposer.valid(r.request_id) or 0, r.computed)
            if valid == 0:
                continue
            ids = [*r.tokens, *r.output_ids][:valid]
            want_k, want_v = dense_kv(draft, ids)
            pages = torch.tensor([r.page_table[p // ps] for p in range(valid)])
            offsets = torch.tensor([p % ps for p in range(valid)])
            torch.testing.assert_close(cache.k[:, pages, offsets], want_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[:, pages, offsets], want_v, atol=1e-5, rtol=1e-5)
            checked["kv"] += valid

    original = DraftModelProposer.propose

    def recording(self: DraftModelProposer, windows: Sequence[Window]) -> Any:
        drafts = original(self, windows)
        for w, d in zip(windows, drafts):
            if d.tokens:
                proposals.append((list(w.history), d.tokens))
        return drafts

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DraftModelProposer, "propose", recording)
        got = run(
            tiny.model,
            prompts,
            10,
            spec=draft_spec(3),
            draft=draft,
            page_size=2,
            num_pages=15,
            budget=9,
            arrivals=[0, 1, 2, 2],
            on_step=on_step,
        )
    assert any(rec.reused for rec in got.records) and any(rec.preempted for rec in got.records)
    assert total(got.records, "rolled_back") > 0
    for history, guesses in proposals:
        assert list(guesses) == dense_greedy(draft, history, len(guesses))
        checked["proposals"] += 1
    assert checked["kv"] > 100 and checked["proposals"] > 10


def test_a_draft_reads_valid_kv_from_another_requests_generated_blocks(tiny: Tiny) -> None:
    """With output caching a block is published while the draft KV of its last accepted guess is still
    missing (the draft never feeds its last guess back), and a request that finishes never catches up.  A
    next turn that reuses that block must not read the gap: its draft KV through the reused pages equals a
    dense draft forward and every guess is the dense draft's greedy choice (the draft is the full model, so
    every guess of turn 1 is accepted and its last windows end on such gaps)."""
    draft = tiny.model.truncated(tiny.model.arch.num_layers)
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="tiny", adaptive=False)
    ex = TorchExecutor(tiny.model, 64, 4, speculative=spec, draft_model=draft)
    proposer = ex.proposer
    assert isinstance(proposer, DraftModelProposer)
    firsts = random_prompts([6, 9, 5], seed=91)
    engine = m16.Engine([], 64, 4, 64, spec_len=3, executors=[ex], eos_token_ids=(), output_caching=True)

    def submit(rid: str, prompt: list[int], n: int) -> m16.Request:
        r = m16.Request(rid, list(prompt), n)
        assert engine.add_request(r) is None
        ex.add_request(ExecutorRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n)))
        return r

    def step_done(record: m16.StepRecord) -> None:
        ex.settle(record.accepted)
        for rid in record.finished:
            ex.release(rid)

    # lengths such that every last window ends a block: P + n - 1 is a multiple of the page size
    turn1 = [submit(f"a{i}", p, n) for i, (p, n) in enumerate(zip(firsts, (7, 8, 8)))]
    engine.run(step_done)
    gaps = {page: set(offsets) for page, offsets in proposer._stale.items() if engine.pool.owner[page] is m16.CACHE}
    assert gaps, "no cached block was left with a draft-KV gap"
    proposals: list[tuple[list[int], tuple[int, ...]]] = []
    original = DraftModelProposer.propose

    def recording(self: DraftModelProposer, windows: Sequence[Window]) -> Any:
        drafts = original(self, windows)
        proposals.extend((list(w.history), d.tokens) for w, d in zip(windows, drafts) if d.tokens)
        return drafts

    turn2 = [submit(f"b{i}", [*r.tokens, *r.output_ids[:-1], 7, 8], 6) for i, r in enumerate(turn1)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DraftModelProposer, "propose", recording)
        records = engine.run(step_done)
    reused = {rid: n for rec in records for rid, n in rec.reused.items()}
    assert all(reused[r.request_id] > len(first.tokens) for r, first in zip(turn2, turn1)), reused
    assert any(page in gaps for page in {p for r in turn2 for p in engine.cache.match(r.prompt_keys)})
    for history, guesses in proposals:
        assert list(guesses) == dense_greedy(draft, history, len(guesses))
    assert proposals and all(
        rec.accepted.get(r.request_id) == rec.drafted.get(r.request_id)
        for rec in records
        for r in turn2
        if r.request_id in rec.drafted
    )
    ps = 4
    for r in turn2:  # the draft KV of the whole sequence, reused pages included
        ids = [*r.tokens, *r.output_ids][: r.computed]
        want_k, _ = dense_kv(draft, ids)
        table = engine.cache.match(m16.prefix_keys(ids, ps))
        pages = torch.tensor([table[p // ps] for p in range(len(table) * ps)])
        offsets = torch.tensor([p % ps for p in range(len(table) * ps)])
        torch.testing.assert_close(
            proposer.cache.k[:, pages, offsets], want_k[:, : len(table) * ps], atol=1e-5, rtol=1e-5
        )


# BC16 and BC22 kinds, with every proposer --------------------------------------------------------------------------

CYCLE = [3, 5, 2, 7, 4, 6, 1]


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """A real 1-layer Llama whose greedy successor of id ``CYCLE[i]`` is ``CYCLE[i + 1]`` (cyclically)."""
    path = tmp_path_factory.mktemp("cycle")
    save_cycle_model(path, CYCLE)
    return load_model(str(path), tokenizer=False).model


@pytest.fixture(scope="module")
def cycle_head(cycle_model: LlamaModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE head trained in seconds on the cycle model's own continuations: it guesses the cycle."""
    prompts = [[CYCLE[(s + i) % len(CYCLE)] for i in range(n)] for s, n in enumerate([3, 5, 8, 4, 9, 6, 10])]
    sequences = greedy_sequences(cycle_model, prompts, 24)
    return train_tiny_head(cycle_model, tmp_path_factory.mktemp("cycle-head"), sequences, steps=100)


PROPOSERS = ["ngram", "suffix", "draft", "eagle"]


def cycle_setup(
    proposer: str, model: LlamaModel, k: int, head: Path | None = None
) -> tuple[SpeculativeConfig, LlamaModel | None]:
    if proposer in MODEL_FREE:
        return replace(MODEL_FREE[proposer], num_speculative_tokens=k), None
    if proposer == "eagle":
        assert head is not None
        return eagle_spec(head, k), None
    return draft_spec(k), model  # the draft is the model itself: it proposes the true continuation


PROMPT = [*CYCLE, *CYCLE[:2]]  # continues 2, 7, 4, 6, 1, 3, 5, ... and prompt lookup knows it
CONT = [2, 7, 4, 6, 1, 3, 5, 2]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_bc16_stop_or_eos_inside_an_accepted_run_wins_over_the_cap(
    cycle_model: LlamaModel, cycle_head: Path, proposer: str
) -> None:
    """max_tokens 5, spec_len 5: one window accepts [7, 4, 6] and the stop id 4 cuts it: [2, 7, 4], STOP."""
    spec, draft = cycle_setup(proposer, cycle_model, 5, cycle_head)
    assert run(cycle_model, [PROMPT], 8).outputs["r0"] == CONT
    stop = run(cycle_model, [PROMPT], 5, spec=spec, draft=draft, stop_token_ids=(4,))
    assert stop.outputs["r0"] == [2, 7, 4] and stop.finish["r0"] == "STOP"
    window = next(rec for rec in stop.records if rec.drafted.get("r0"))
    assert (window.drafted["r0"], window.accepted["r0"], window.rolled_back["r0"]) == (3, 1, 2)
    assert window.tokens["r0"] == (7, 4)
    eos = run(cycle_model, [PROMPT], 5, spec=spec, draft=draft, eos=(4,))
    assert eos.outputs["r0"] == [2, 7, 4] and eos.finish["r0"] == "EOS"
    # the control: a stop id past the cap is never reached, and the cap holds exactly
    late = run(cycle_model, [PROMPT], 5, spec=spec, draft=draft, stop_token_ids=(3,))
    assert late.outputs["r0"] == CONT[:5] and late.finish["r0"] == "LENGTH"


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_bc22_zero_and_two_drafts_share_steps(cycle_model: LlamaModel, cycle_head: Path, proposer: str) -> None:
    """A (5 tokens) has 0 drafts at its last step while B (10 tokens) has 2; each equals its run alone.
    B with 11 tokens ends on a step where every window has 0 drafts: plain decode, one token."""
    spec, draft = cycle_setup(proposer, cycle_model, 2, cycle_head)
    a, b = [7, 4, 6, 1, 3, 5, 2, 7, 4], PROMPT
    alone_a, alone_b = run(cycle_model, [a], 5).outputs["r0"], run(cycle_model, [b], 11).outputs["r0"]
    both = run(cycle_model, [a, b], [5, 10], spec=spec, draft=draft)
    assert both.outputs["r0"] == alone_a and both.outputs["r1"] == alone_b[:10]
    assert len(both.outputs["r0"]) == 5 and len(both.outputs["r1"]) == 10
    assert any(rec.drafted.get("r0") == 0 and rec.drafted.get("r1") == 2 for rec in both.records)
    assert total(both.records, "accepted") > 0
    longer = run(cycle_model, [a, b], [5, 11], spec=spec, draft=draft)
    assert longer.outputs["r1"] == alone_b
    tail = [rec for rec in longer.records if rec.drafted and not any(rec.drafted.values())]
    assert tail and all(len(rec.tokens[rid]) == 1 for rec in tail for rid in rec.drafted)


class LetterTokenizer:
    """Id ``i`` is the letter ``"abcdefghijklmnop"[i]``; no special tokens."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return "".join("abcdefghijklmnop"[i] for i in ids)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_a_stop_string_inside_an_accepted_run_cuts_ids_and_text(
    cycle_model: LlamaModel, cycle_head: Path, proposer: str
) -> None:
    """The continuation c h e g b d f ... arrives as accepted runs; the stop string "he" ends inside one."""
    spec, _ = cycle_setup(proposer, cycle_model, 4, cycle_head)
    if proposer == "draft":
        spec = replace(spec, draft_model=f"{Path(cycle_model.config._name_or_path)}:layers=1")
    core = EngineCore(
        LoadedModel(Path(cycle_model.config._name_or_path), cycle_model, LetterTokenizer(), ()),
        EngineConfig(page_size=4, num_pages=32, speculative=replace(spec, adaptive=False)),
    )
    core.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop=["he"], logprobs=0))
    outs = drain(core)
    (done,) = [o.outputs[0] for step in outs for o in step.finished]
    assert (done.text, done.finish_reason, done.stop_reason) == ("c", "stop", "he")
    assert done.token_ids == [2, 7, 4] and [next(iter(lp)) for lp in done.logprobs or []] == [2, 7, 4]
    # The step that found the string reports what the request kept: its ids, and as accepted only the
    # guesses before the cut; the guesses after it count as rolled back.
    last = next(step.record for step in outs if step.record.finished)
    kept = last.tokens["0"]
    assert last.finished["0"] is m16.FinishReason.STOP and list(kept) == [2, 7, 4][-len(kept) :]
    assert last.accepted["0"] == len(kept) - 1 < last.drafted["0"]
    assert last.rolled_back["0"] == last.drafted["0"] - last.accepted["0"]
    assert not last.aborted and core.summary()[0]["state"] == "FINISHED"
    core.check_pages()


LETTERS = "abcdefghijklmnop"
SUCCESSOR = {a: b for a, b in zip(CYCLE, [*CYCLE[1:], CYCLE[0]])}


def cycle_run(
    model: LlamaModel,
    prompt: Sequence[int],
    params: SamplingParams,
    spec: SpeculativeConfig | None,
    eos: tuple[int, ...],
) -> Any:
    """One request through ``EngineCore`` on the cycle model (letters as text); its final output, pages checked."""
    core = EngineCore(
        LoadedModel(Path(model.config._name_or_path), model, LetterTokenizer(), eos),
        EngineConfig(page_size=4, num_pages=32, speculative=spec),
    )
    core.add_request(list(prompt), params)
    (done,) = [o.outputs[0] for step in drain(core) for o in step.finished]
    core.check_pages()
    return done, core


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    start=st.integers(0, len(CYCLE) - 1),
    length=st.integers(len(CYCLE) + 1, 2 * len(CYCLE) + 2),
    k=st.integers(1, 5),
    proposer=st.sampled_from(PROPOSERS),
    max_tokens=st.integers(1, 14),
    stop_ids=st.lists(st.sampled_from(CYCLE), max_size=2, unique=True),
    eos=st.lists(st.sampled_from(CYCLE), max_size=1),
    stop_string=st.one_of(st.none(), st.text(alphabet="".join(LETTERS[i] for i in CYCLE), min_size=1, max_size=3)),
)
def test_no_id_or_text_after_the_earliest_stop_eos_or_cap(
    cycle_model: LlamaModel,
    cycle_head: Path,
    start: int,
    length: int,
    k: int,
    proposer: str,
    max_tokens: int,
    stop_ids: list[int],
    eos: list[int],
    stop_string: str | None,
) -> None:
    """BC16's invariant over its whole kind, on the real executor with either proposer: whatever ends a request
    (an EOS id, a stop id, a stop string, max_tokens) inside an accepted run of any length, nothing after it is
    emitted, the result (ids, text, finish and stop reasons) is the non-speculative one, and the executor's
    counters count only the ids the request kept."""
    prompt = [CYCLE[(start + i) % len(CYCLE)] for i in range(length)]
    cont = [SUCCESSOR[prompt[-1]]]
    while len(cont) < max_tokens:
        cont.append(SUCCESSOR[cont[-1]])
    # the oracle: ids up to the earliest terminator (the EOS / stop id itself, the id completing the stop string)
    end = next((j + 1 for j, t in enumerate(cont) if t in eos or t in stop_ids), max_tokens)
    if stop_string is not None:
        text = ""
        for j, t in enumerate(cont[:end]):
            text += LETTERS[t]
            if stop_string in text:
                end = j + 1
                break
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids, stop=stop_string)
    spec, _ = cycle_setup(proposer, cycle_model, k, cycle_head)
    if proposer == "draft":
        spec = replace(spec, draft_model=f"{Path(cycle_model.config._name_or_path)}:layers=1")
    spec = replace(spec, adaptive=False)  # every window carries k guesses: cuts land inside accepted runs
    plain, _ = cycle_run(cycle_model, prompt, params, None, tuple(eos))
    got, core = cycle_run(cycle_model, prompt, params, spec, tuple(eos))
    assert plain.token_ids == cont[:end]
    assert got.token_ids == cont[:end]
    assert (got.text, got.finish_reason, got.stop_reason) == (plain.text, plain.finish_reason, plain.stop_reason)
    if stop_string is not None:
        assert stop_string not in got.text
    stats = core.executor.stats()
    # what the executor counts is what the request kept: every kept id after the prefill's first one came
    # from a decode window (kept guesses plus one each), whatever cut the last window
    assert stats.emitted == len(got.token_ids) - 1 and stats.accepted <= stats.proposed
    if max_tokens >= 3 and end >= 2:
        assert stats.proposed > 0  # the run really was speculative


# Conformance: the real runs obey the spec -------------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize("name", ["shared-prefix", "chunked-two-ranks", "admission"])
def test_conformance_replay_contract_and_kv_audit(proposer: str, name: str) -> None:
    """The trace of a run with real drafts replays on the spec, every planned slot is written, the KV audits."""
    from mechserve.conformance import (
        FIXED_WORKLOADS,
        check_contract,
        check_kv,
        check_replay,
        model_workload,
        torch_target,
    )
    from mechserve.conformance import tiny_model as conformance_tiny

    model, hf = conformance_tiny()
    kwargs: dict[str, Any] = {"speculative": MODEL_FREE.get(proposer)}
    if proposer == "draft":
        kwargs = {"speculative": draft_spec(), "draft_model": model.truncated(1)}
    target = torch_target(model, hf=hf, name=f"tiny-{proposer}", **kwargs)
    workload = model_workload(FIXED_WORKLOADS[name], target.vocab_size)
    found = check_replay(target, workload)
    check_contract(target, workload)
    check_kv(target, workload)
    assert found["steps"] > 0


# The adaptive spec_len -------------------------------------------------------------------------------------------


def test_governor_speculates_only_when_it_pays() -> None:
    g = Governor(row_cost=0.05, jump_cost=0.45)
    assert g.choose([], 4) == 0 and g.choose([Candidate(4, 4, 0.9)], 0) == 0
    assert g.choose([Candidate(4, 4, 0.9)], 4) == 4  # a good copier: the whole window
    assert g.choose([Candidate(4, 4, 0.2)], 4) == 0  # rarely accepted: a guess costs more than it brings
    assert g.choose([Candidate(4, 0, 0.9)], 4) == 0  # nothing to propose: pads only cost
    assert g.choose([Candidate(4, 2, 0.9)], 4) == 2  # a short proposal: its window, not more
    assert g.choose([Candidate(1, 4, 0.9)], 4) == 1  # capped by max_new_tokens
    # m16: one copier among eight drafts alone (its seven batchmates are limited to 0, no pad rows);
    # four copiers pay for four
    assert g.decide([Candidate(4, 4, 0.9)] + [Candidate(4, 0, 0.5)] * 7, 4) == (4, [None] + [0] * 7)
    assert g.choose([Candidate(4, 4, 0.9)] * 4 + [Candidate(4, 0, 0.5)] * 4, 4) == 4
    # a draft model's rounds cost: a weak draft is not worth running
    drafting = Governor(draft_costs=(0.2, 0.3, 0.3, 0.3))
    assert drafting.choose([Candidate(4, 4, 0.3)], 4) == 0 and drafting.choose([Candidate(4, 4, 0.95)], 4) == 4


def loaded(model: LlamaModel, path: Path) -> LoadedModel:
    return LoadedModel(path, model, None, ())


def static_core(model: LlamaModel, config: EngineConfig) -> EngineCore:
    """An ``EngineCore`` whose governor prices guesses with the static cost model (``StaticCosts``' defaults),
    not with costs measured on this machine: a test of the governor's decisions is then reproducible (the
    measured costs are tested on a synthetic clock, ``test_spec_costs.py``)."""
    spec = config.speculative_config()
    executor = None
    if spec is not None:
        executor = TorchExecutor(model, config.num_pages, config.page_size, speculative=spec, governor=Governor())
    return EngineCore(loaded(model, Path("/nonexistent")), config, executor=executor)


def drain(core: EngineCore) -> list[Any]:
    outs = []
    while core.has_unfinished():
        outs.append(core.step())
    return outs


def test_adaptive_spec_len_backs_off_and_keeps_the_output(tiny: Tiny, cycle_model: LlamaModel) -> None:
    """EngineCore sets spec_len each step: high on a predictable request, 0 where lookup finds nothing."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    adaptive = EngineConfig(page_size=4, num_pages=64, speculative=SpeculativeConfig(num_speculative_tokens=4))
    plain = EngineConfig(page_size=4, num_pages=64)

    def outputs(model: LlamaModel, config: EngineConfig, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
        core = static_core(model, config)
        for p in prompts:
            core.add_request(p, params)
        records = [o.record for o in drain(core)]
        return [list(r.output_ids) for r in core.scheduler.spec_engine.requests], (records, core.executor.stats())

    got, (records, stats) = outputs(cycle_model, adaptive, [PROMPT])
    assert got == outputs(cycle_model, plain, [PROMPT])[0]
    assert stats.accepted > 12 and stats.forwards < 10  # 24 tokens in a few windows
    assert max(max(rec.drafted.values(), default=0) for rec in records) == 4
    prompts = random_prompts([11, 6], seed=5)
    got, (records, stats) = outputs(tiny.model, adaptive, prompts)
    assert got == outputs(tiny.model, plain, prompts)[0]
    windows = [d for rec in records for d in rec.drafted.values()]
    assert windows.count(0) > len(windows) // 2  # lookup rarely helps on random ids: mostly plain decode


# Configuration ---------------------------------------------------------------------------------------------------


def test_speculative_config_checks() -> None:
    assert SpeculativeConfig().num_speculative_tokens == 3
    for bad, match in [
        (dict(method="medusa"), "method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(ngram_min=0), "ngram_min"),
        (dict(ngram_min=3, ngram_max=2), "ngram_max"),
        (dict(method="draft"), "needs a draft_model"),
        (dict(method="ngram", draft_model="smollm2:layers=2"), 'method="draft"'),
        (dict(method="draft", draft_model="smollm2:layers=0"), "layers must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(**bad)
    assert parse_draft_model("smollm2:layers=4") == ("smollm2", 4)
    assert parse_draft_model("/models/a:b") == ("/models/a:b", None)
    assert EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=5)).spec_len == 5
    assert EngineConfig(spec_len=2).speculative_config() == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig().speculative_config() is None
    with pytest.raises(ValueError, match="differs from"):
        EngineConfig(spec_len=2, speculative=SpeculativeConfig(num_speculative_tokens=5))
    assert SpeculativeConfig.of({"model": "smollm2:layers=2", "num_speculative_tokens": 2}) == SpeculativeConfig(
        method="draft", num_speculative_tokens=2, draft_model="smollm2:layers=2"
    )
    assert SpeculativeConfig.of({"prompt_lookup_max": 4}).ngram_max == 4
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.of({"draft_tensor_parallel_size": 1})


def test_a_draft_model_must_share_the_vocabulary(tiny: Tiny, tmp_path: Path) -> None:
    other_config = tiny_config(vocab_size=96)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(other_config).save_pretrained(tmp_path / "other")
    target = LoadedModel(tiny.path, tiny.model, None, ())
    spec = SpeculativeConfig(method="draft", draft_model=f"{tmp_path / 'other'}:layers=1")
    with pytest.raises(ValueError, match="vocabulary of 96 ids, the target 128"):
        EngineCore(target, EngineConfig(num_pages=8, speculative=spec))
    too_deep = SpeculativeConfig(method="draft", draft_model=f"{tiny.path}:layers=3")
    with pytest.raises(ValueError, match="layers=3, but the model has 2"):
        EngineCore(target, EngineConfig(num_pages=8, speculative=too_deep))
    with pytest.raises(ValueError, match="vocabulary"):
        TorchExecutor(tiny.model, 8, 4, draft_model=load_model(str(tmp_path / "other"), tokenizer=False).model)
    with pytest.raises(ValueError, match="needs a draft_model"):
        TorchExecutor(tiny.model, 8, 4, speculative=draft_spec())


def test_the_draft_shares_the_targets_weights(tiny: Tiny) -> None:
    target = LoadedModel(tiny.path, tiny.model, None, ())
    spec = replace(draft_spec(2), draft_model=f"{tiny.path}:layers=1")
    core = EngineCore(target, EngineConfig(num_pages=8, speculative=spec))
    proposer = core.executor.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.model.layers[0].qkv is tiny.model.layers[0].qkv and proposer.model.arch.num_layers == 1
    assert core.kv_bytes > 8 * 2 * 2 * 4 * 2 * 32 * 4  # the draft's pages are counted


def test_generate_function_with_a_draft_model(tiny: Tiny) -> None:
    prompts = PROMPTS[:3]
    want = generate(tiny.model, prompts, 8, config=EngineConfig(page_size=4)).completions
    config = EngineConfig(page_size=4, speculative=replace(draft_spec(2), draft_model=f"{tiny.path}:layers=1"))
    got = generate(tiny.model, prompts, 8, config=config).completions
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory, tiny: Tiny) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-spec-cli")
    tiny.hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def test_generate_cli_speculates_with_either_proposer(
    tiny_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tiny_with_tokenizer)
    prompt = " ".join(f"w{t}" for t in copy_heavy(3))
    base = ["--model", path, "--max-tokens", "12", "--json", "-q"]
    rc, out, err = cli([prompt, *base], capsys)
    assert rc == 0, err
    want = json.loads(out.splitlines()[-1])["outputs"][0]["token_ids"]
    for extra in (
        ["--spec-len", "3"],
        ["--spec-method", "ngram", "--spec-len", "4", "--ngram-max", "2", "--spec-fixed"],
        ["--draft-model", f"{path}:layers=1", "--spec-fixed"],
        ["--spec-method", "draft", "--draft-model", f"{path}:layers=2", "--spec-len", "2"],
        ["--spec-method", "suffix", "--spec-len", "4", "--suffix-decoding-max-tree-depth", "12", "--spec-fixed"],
    ):
        rc, out, err = cli([prompt, *base, *extra], capsys)
        assert rc == 0, (extra, err)
        assert json.loads(out.splitlines()[-1])["outputs"][0]["token_ids"] == want, extra
    rc, out, err = cli([prompt, "--model", path, "--max-tokens", "6", "--spec-len", "2"], capsys)
    assert rc == 0 and "speculation (ngram):" in out, err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--spec-method", "draft"], "--spec-method draft needs --draft-model"),
        (["--spec-method", "ngram", "--draft-model", "smollm2:layers=2"], "use --spec-method draft"),
        (["--spec-method", "ngram", "--spec-len", "0"], "needs --spec-len >= 1"),
        (["--spec-len", "2", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min 3 is more than --ngram-max 2"),
        (["--draft-model", "smollm2:layers=0"], "layers must be >= 1"),
        (["--suffix-decoding-max-tree-depth", "8"], "--suffix-decoding-max-tree-depth is an option of --spec-method"),
        (
            ["--spec-method", "suffix", "--suffix-decoding-max-tree-depth", "1"],
            "expected an integer in [2, 256], got '1'",
        ),
        (["--spec-method", "suffix", "--suffix-decoding-min-token-prob", "2"], "--suffix-decoding-min-token-prob"),
        (["--spec-method", "suffix", "--suffix-decoding-max-spec-factor", "x"], "expected a finite number, got 'x'"),
    ],
)
def test_generate_cli_speculation_errors(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["w1 w2", "--model", "/nonexistent", *flags], capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_model_checkpoint_truncation_is_a_view(tiny: Tiny) -> None:
    draft = tiny.model.truncated(1)
    assert draft.arch.num_layers == 1 and len(draft.layers) == 1 and tiny.model.arch.num_layers == 2
    assert draft.embed is tiny.model.embed and draft.lm_head is tiny.model.lm_head
    with pytest.raises(ValueError, match="num_layers"):
        tiny.model.truncated(3)


class NeverRightProposer:
    """Guesses that are never accepted on the cycle model: the id two places ahead of the true successor."""

    @classmethod
    def build(cls, ctx: Any) -> NeverRightProposer:
        return cls()

    def propose(self, windows: Sequence[Window]) -> list[Any]:
        from mechserve.executor.proposers import NO_DRAFT, Draft

        return [Draft(self._ids(w.history, w.slots)) if w.slots else NO_DRAFT for w in windows]

    def available(self, request: Any, history: Sequence[int], cap: int) -> int:
        return cap

    def release(self, request: Any, output_ids: Sequence[int]) -> None:
        pass

    def _ids(self, history: Sequence[int], num: int) -> tuple[int, ...]:
        wrong = SUCCESSOR[SUCCESSOR[SUCCESSOR[history[-1]]]]
        return (wrong,) * num


@pytest.mark.parametrize("batch", [1, 3])
def test_the_governor_backs_off_a_request_whose_guesses_never_pay(
    cycle_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Issue 27 item 4: a proposer whose every guess is rejected is probed ever more rarely (exponential
    back-off per request), so it costs a few windows over a long answer, not one every ~11 steps at batch 1
    and every step at batch 3 (where a guess row looks almost free to the cost model)."""
    from mechserve.api.proposers import PROPOSERS, ProposerMethod
    from mechserve.executor.governor import Acceptance

    monkeypatch.setitem(  # type: ignore[call-overload]
        PROPOSERS, "never", ProposerMethod("never", "always wrong", f"{__name__}:NeverRightProposer.build")
    )
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompts = [[CYCLE[(i + j) % len(CYCLE)] for j in range(9)] for i in range(batch)]

    def probes(config: EngineConfig) -> tuple[int, Any]:
        core = static_core(cycle_model, config)
        for p in prompts:
            core.add_request(p, params)
        records = [o.record for o in drain(core)]
        outs = [list(r.output_ids) for r in core.scheduler.spec_engine.requests]
        return sum(1 for rec in records if any(rec.drafted.values())), outs

    spec = SpeculativeConfig(method="never", num_speculative_tokens=4)
    config = EngineConfig(page_size=4, num_pages=256, speculative=spec)
    backed_off, outs = probes(config)
    assert outs == probes(EngineConfig(page_size=4, num_pages=256))[1]
    monkeypatch.setattr(Acceptance, "GRACE", 10**9)  # the governor before the back-off
    every_so_often, _ = probes(config)
    assert backed_off <= 12 < 20 < every_so_often
