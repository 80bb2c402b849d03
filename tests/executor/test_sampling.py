"""The sampler on its own and at the executor: masks, seeds, min_tokens, logprobs and the sampled distribution."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_checkpoints import Tiny, build_tiny

from mechserve.api.params import SamplingParams
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Row, Sampler, apply_top_p, token_logprobs
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.spec import m16_request_draft_lengths as m16

SLACK = 1e-4  # float32 against the float64 reference at a mask's boundary


def allowed(logits: list[float], params: SamplingParams, banned: tuple[int, ...] = ()) -> set[int]:
    """The ids a row may emit, from the definitions, in float64; a superset at float boundaries.

    Greedy: the argmax ids.  Else, over ``x = logits / T``: top-k keeps ids with
    fewer than k strictly larger logits; top-p keeps ids whose strictly more likely
    ids (after top-k, renormalised) hold less than p; min-p keeps ids with
    ``p_i >= min_p * p_max`` (a ratio, so the earlier masks do not change it).
    """
    x = np.array(logits, dtype=np.float64)
    x[list(banned)] = -np.inf
    if params.greedy:
        return {int(i) for i in np.flatnonzero(x == x.max())}
    x = x / params.temperature
    keep = np.isfinite(x)
    if 0 < params.top_k < len(x):
        above = (x[None, :] > x[:, None]).sum(axis=1)
        keep &= above < params.top_k
    if params.top_p < 1:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        p /= p.sum()
        mass_above = (np.where(p[None, :] > p[:, None], p[None, :], 0.0)).sum(axis=1)
        keep &= mass_above < params.top_p + SLACK
    if params.min_p > 0:
        keep &= np.exp(x - x.max()) >= params.min_p * (1 - SLACK)
    return {int(i) for i in np.flatnonzero(keep)}


half_steps = st.integers(-12, 12).map(lambda i: i / 2)  # ties are common
row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.5]),
    top_k=st.sampled_from([-1, 0, 1, 2, 3, 7, 50]),
    top_p=st.sampled_from([1e-6, 0.1, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    min_tokens=st.integers(0, 2),
)


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(2, 24),
    data=st.data(),
)
def test_masked_ids_are_never_emitted(vocab: int, data: st.DataObject) -> None:
    """Top-k / top-p / min-p and min_tokens bans, mixed with greedy rows in one batch: every id is allowed."""
    n = data.draw(st.integers(1, 5))
    logits = [data.draw(st.lists(half_steps, min_size=vocab, max_size=vocab)) for _ in range(n)]
    rows = [
        Row(data.draw(row_params), data.draw(st.integers(0, 3)), data.draw(st.sets(st.integers(0, vocab - 2))))
        for _ in range(n)
    ]
    rows = [Row(r.params, r.token_index, tuple(sorted(r.banned))) for r in rows]
    sampler = Sampler(seed=data.draw(st.integers(0, 2**32)))
    sampler.top_p_candidates = data.draw(st.integers(1, vocab + 1))  # below V: top-p's fallback sort runs too
    for _ in range(3):
        ids = sampler.choose(torch.tensor(logits, dtype=torch.float32), rows)
        for lg, row, t in zip(logits, rows, ids):
            ban = row.banned if row.token_index < row.params.min_tokens else ()
            assert t in allowed(lg, row.params, ban), (lg, row, t)


@settings(max_examples=100, deadline=None)
@given(
    vocab=st.integers(2, 40),
    data=st.data(),
)
def test_a_seeded_row_ignores_its_batchmates(vocab: int, data: st.DataObject) -> None:
    """A seeded row's id depends on its logits, params and token index only: not on other rows or their order."""
    mine = data.draw(st.lists(half_steps, min_size=vocab, max_size=vocab))
    params = data.draw(row_params.filter(lambda p: p.seed is not None and not p.greedy))
    row = Row(params, data.draw(st.integers(0, 10_000)))
    alone = Sampler(seed=1).choose(torch.tensor([mine]), [row])
    others = data.draw(
        st.lists(st.tuples(st.lists(half_steps, min_size=vocab, max_size=vocab), row_params), max_size=4)
    )
    at = data.draw(st.integers(0, len(others)))
    logits = [lg for lg, _ in others]
    rows = [Row(p, 0) for _, p in others]
    logits.insert(at, mine)
    rows.insert(at, row)
    batched = Sampler(seed=data.draw(st.integers(0, 99))).choose(torch.tensor(logits), rows)
    assert batched[at] == alone[0]


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 30),
    data=st.data(),
)
def test_top_p_candidates_do_not_change_the_kept_set(vocab: int, data: st.DataObject) -> None:
    """apply_top_p finds the same boundary from any number of candidates as from the whole sorted vocabulary."""
    n = data.draw(st.integers(1, 4))
    logits = torch.tensor([data.draw(st.lists(half_steps, min_size=vocab, max_size=vocab)) for _ in range(n)])
    probs = torch.softmax(logits, dim=-1)
    p = torch.tensor(data.draw(st.lists(st.sampled_from([1e-6, 0.3, 0.5, 0.9, 0.999, 1.0]), min_size=n, max_size=n)))
    full = apply_top_p(probs.clone(), p, candidates=vocab)
    assert torch.equal(apply_top_p(probs.clone(), p, candidates=data.draw(st.integers(1, vocab))), full)
    assert torch.equal(full[p >= 1], probs[p >= 1])


def test_greedy_rows_are_the_argmax_and_logits_stay_untouched() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    before = logits.clone()
    rows = [Row(SamplingParams(temperature=0.0), 0), Row(SamplingParams(top_k=1, seed=3), 4)] * 3
    assert Sampler().choose(logits, rows) == logits.argmax(-1).tolist()
    mixed = [Row(SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1, seed=5), 0), *rows[1:]]
    mixed[2] = Row(SamplingParams(temperature=0.0, min_tokens=3), 1, tuple(logits[2].topk(2).indices.tolist()))
    ids = Sampler().choose(logits, mixed)
    assert torch.equal(logits, before)
    assert ids[1] == int(logits[1].argmax())
    assert ids[2] == int(logits[2].topk(3).indices[2])  # the two best ids are banned below min_tokens


def test_min_tokens_bans_end_ids_only_below_min_tokens() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 7] = 50.0  # 7 is overwhelmingly likely
    params = SamplingParams(temperature=1.0, min_tokens=2, seed=0)
    rows = [Row(params, i, (7,)) for i in range(4)]
    ids = Sampler().choose(logits, rows)
    assert ids[0] != 7 and ids[1] != 7
    assert ids[2:] == [7, 7]


def test_row_seed_is_stable() -> None:
    """Pinned values: a change here changes every seeded request's output (a compatibility break)."""
    from mechserve.executor.sampling import row_seed

    assert row_seed(42, 0) == row_seed(42, 0) != row_seed(42, 1) != row_seed(43, 0)
    assert [row_seed(42, i) for i in range(3)] == PINNED_ROW_SEEDS
    assert all(0 <= row_seed(s, i) < 2**64 for s in (-1, 0, 2**64 - 1) for i in (0, 5))


PINNED_ROW_SEEDS = [10996452266160306281, 2958219263312191191, 3069497704473277141]


def test_token_logprobs_against_log_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=g) * 3
    ref = torch.log_softmax(logits.double(), -1)
    got = token_logprobs(logits, [4, 17, 0], [5, 0, 30])
    for row, lp, n in zip(range(3), got, [5, 0, 30]):
        assert lp.token_id == [4, 17, 0][row]
        assert abs(lp.logprob - float(ref[row, lp.token_id])) < 1e-5
        assert lp.rank == 1 + int((ref[row] > ref[row, lp.token_id]).sum())
        want = ref[row].topk(n)
        assert list(lp.top_ids) == want.indices.tolist()
        assert np.allclose(lp.top_logprobs, want.values.tolist(), atol=1e-5)
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        as_dict = lp.to_dict(lambda t: f"t{t}")
        assert next(iter(as_dict)) == lp.token_id and as_dict[lp.token_id].logprob == lp.logprob
        assert len(as_dict) in (n, n + 1) and all(v.decoded_token == f"t{t}" for t, v in as_dict.items())
        assert [v.rank for t, v in as_dict.items() if t != lp.token_id] == [
            i + 1 for i, t in enumerate(lp.top_ids) if t != lp.token_id
        ]


# The sampled distribution ------------------------------------------------------------------------------------------

CHI2_ALPHA = 1e-3  # reject when P(chi2 >= stat) < 1e-3; the seeds are fixed, so the outcome is too
DRAWS = 4000  # one position, DRAWS independent requests: expected count >= 45 in every bin of the model below


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): 1 - the regularised lower incomplete gamma P(df/2, stat/2) (series)."""
    a, x = df / 2, stat / 2
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-15:
        term *= x / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(-x + a * math.log(x) - math.lgamma(a)) * total)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A 16-token random Llama whose distribution after [3, 5, 7] spans 0.012 .. 0.29 (no empty bin)."""
    return build_tiny(Path(tmp_path_factory.mktemp("tiny-v16")), vocab_size=16, initializer_range=0.1)


PROMPT = [3, 5, 7]


def sample_once_each(tiny: Tiny, params: list[SamplingParams], sampler_seed: int = 0) -> list[int]:
    """One step of the executor: every request prefills PROMPT and samples its first token."""
    ex = TorchExecutor(tiny.model, num_pages=len(params), page_size=4, sampler=Sampler(seed=sampler_seed))
    plan = []
    for i, p in enumerate(params):
        ex.add_request(ExecutorRequest(f"r{i}", PROMPT, p))
        placements = tuple((pos, i, pos) for pos in range(len(PROMPT)))
        plan.append(m16.PlanItem(f"r{i}", 0, len(PROMPT), 0, False, placements, tuple(PROMPT), True, 0, (i,)))
    return [o.token_ids[0] for o in ex.execute(tuple(plan))]


def reference_probs(tiny: Tiny, params: SamplingParams) -> np.ndarray:
    """transformers' distribution at the last prompt position after temperature, top-k, top-p, min-p (float64)."""
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    keep = np.zeros(len(logits), dtype=bool)
    keep[sorted(allowed(logits.tolist(), params))] = True
    p = np.where(keep, np.exp((logits - logits.max()) / params.temperature), 0.0)
    return p / p.sum()


def chi2_pvalue(draws: list[int], probs: np.ndarray) -> float:
    counts = Counter(draws)
    assert all(probs[t] > 0 for t in counts), "a masked id was drawn"
    support = np.flatnonzero(probs > 0)
    expected = probs[support] * len(draws)
    observed = np.array([counts[int(t)] for t in support])
    stat = float(((observed - expected) ** 2 / expected).sum())
    return chi2_sf(stat, len(support) - 1)


MASKED = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), MASKED], ids=["softmax", "masked"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampling_matches_the_distribution(small_vocab: Tiny, params: SamplingParams, seeded: bool) -> None:
    """Chi-square over DRAWS requests (seeds 0..DRAWS-1, or the shared generator): p-value above CHI2_ALPHA."""
    from dataclasses import replace

    many = [replace(params, seed=s if seeded else None) for s in range(DRAWS)]
    draws = sample_once_each(small_vocab, many)
    assert chi2_pvalue(draws, reference_probs(small_vocab, params)) > CHI2_ALPHA


def test_the_chi_square_check_has_power(small_vocab: Tiny) -> None:
    """The same check rejects draws at temperature 1.5 against the temperature-1 distribution."""
    hot = [SamplingParams(temperature=1.5, seed=s) for s in range(DRAWS)]
    draws = sample_once_each(small_vocab, hot)
    assert chi2_pvalue(draws, reference_probs(small_vocab, SamplingParams(temperature=1.0))) < CHI2_ALPHA


def test_token_logprobs_of_no_rows_is_empty() -> None:
    """A batch of no rows asks for no top ids (``max`` of no counts is 0) and gets no logprobs."""
    assert token_logprobs(torch.zeros(0, 30), [], []) == []


class PlacedLogits:
    """Stands for a logits tensor on device ``kind``: what ``sampling_logits`` reads of it, and a ``cpu()``
    that says it was called (so a CPU tensor is shown to come back itself, not as a copy of itself)."""

    def __init__(self, kind: str) -> None:
        self.device = torch.device(kind)
        self.copied = False

    def cpu(self) -> str:
        self.copied = True
        return "host copy"


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_sampling_logits_copy_to_the_host_only_what_the_host_must_do(kind: str) -> None:
    from mechserve.executor.sampling import sampling_logits

    plain = Row(SamplingParams(temperature=0.0), 0)
    cases = [
        ([plain, plain], {}, False),  # plain greedy: one argmax where the logits are
        ([plain], {"host": True}, True),  # the caller needs them on the host (logprobs)
        ([plain, Row(SamplingParams(temperature=1.0), 0)], {}, True),  # a sampling row: the generators are there
        ([plain, Row(SamplingParams(temperature=0.0, min_tokens=2), 0, (5,))], {}, True),  # greedy, but banned ids
        ([Row(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, history=(3,))], {}, True),  # penalties
    ]
    for rows, kwargs, to_host in cases:
        logits = PlacedLogits(kind)
        got = sampling_logits(logits, rows, **kwargs)  # type: ignore[arg-type]
        if kind == "cpu" or not to_host:
            assert got is logits and not logits.copied, (kind, rows, kwargs)
        else:
            assert got == "host copy", (rows, kwargs)


def test_the_draw_workspace_is_float64_reused_and_grown_on_demand() -> None:
    """``-log(U)`` needs U in float64 (``Sampler._exponentials``): float32 U can be 0 and is coarse near 1."""
    s = Sampler(seed=0)
    first = s._workspace(torch.Size([3, 7]))
    assert first.shape == (3, 7) and first.dtype == torch.float64
    fewer = s._workspace(torch.Size([2, 7]))
    same = s._workspace(torch.Size([3, 7]))
    assert fewer.shape == (2, 7) and fewer.data_ptr() == same.data_ptr() == first.data_ptr()  # no new buffer
    more = s._workspace(torch.Size([5, 7]))
    assert more.shape == (5, 7) and more.dtype == torch.float64
    assert s._workspace(torch.Size([1, 7])).data_ptr() == more.data_ptr()  # the grown buffer is kept
    other = s._workspace(torch.Size([2, 4]))  # another vocabulary: a buffer of its width
    assert other.shape == (2, 4) and other.dtype == torch.float64 and other.is_contiguous()
    q = s._exponentials([Row(SamplingParams(temperature=1.0), 0)] * 2, torch.Size([2, 4]))
    assert q.shape == (2, 4) and q.dtype == torch.float32 and bool((q > 0).all())


def test_top_k_keeps_exactly_the_k_largest_and_their_ties() -> None:
    """The sampled distribution (``Sampler.probs``) under top-k: the k largest logits and any tied with the
    k-th, nothing else (the masked-ids property checks only that no masked id is emitted, which a top-k keeping
    fewer ids, or none, passes)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 2.0], [0.0, 3.0, 1.0, 2.0, -1.0, 0.5]])
    rows = [Row(SamplingParams(temperature=1.0, top_k=3), 0), Row(SamplingParams(temperature=1.0, top_k=2), 0)]
    probs = Sampler(seed=0).probs(logits, rows)
    assert (probs[0] > 0).nonzero().squeeze(1).tolist() == [1, 3, 5]
    assert (probs[1] > 0).nonzero().squeeze(1).tolist() == [1, 3]
    assert torch.allclose(probs[1, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))


def test_top_p_drops_a_token_once_the_more_likely_ones_hold_exactly_p() -> None:
    """A token stays iff the tokens more likely than it hold *less* than p: with 0.5, 0.25, 0.25 (exact in
    binary) and p = 0.5 only the first stays; p just above 0.5 keeps all three (ties with the last kept)."""
    probs = torch.tensor([[0.25, 0.5, 0.125, 0.125], [0.25, 0.5, 0.125, 0.125]])
    got = apply_top_p(probs.clone(), torch.tensor([0.5, 0.5000001]))
    assert got[0].tolist() == [0.0, 0.5, 0.0, 0.0]
    assert got[1].tolist() == [0.25, 0.5, 0.0, 0.0]


def test_a_greedy_rows_distribution_is_a_point_mass_at_its_argmax_in_any_batch() -> None:
    """``Sampler.probs`` (what speculative verification compares): each greedy row exactly one-hot at its own
    argmax, beside a sampling row."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 1.0, 2.0]])
    greedy = Row(SamplingParams(temperature=0.0), 0)
    probs = Sampler(seed=0).probs(logits, [greedy, Row(SamplingParams(temperature=1.0), 0), greedy])
    assert probs[0].tolist() == [0.0, 0.0, 1.0, 0.0] and probs[2].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(probs[1], torch.full((4,), 0.25)) and probs.dtype == torch.float32
    lone = Sampler(seed=0).probs(logits[2:], [greedy])
    assert lone.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_a_draw_of_no_rows_is_empty() -> None:
    """A fresh sampler (an empty draw workspace) drawing for no rows returns no ids."""
    assert Sampler(seed=0).draw(torch.zeros(0, 9), []) == []


def race(probs: torch.Tensor, seed: int, stream: int, token_index: int) -> int:
    """The exponential race for one seeded row, written from the definition (``Sampler._exponentials``)."""
    from mechserve.executor.sampling import row_seed, stream_seed

    gen = torch.Generator().manual_seed(row_seed(stream_seed(seed, stream), token_index))
    u = torch.empty(probs.shape[0], dtype=torch.float64).uniform_(generator=gen)
    return int((probs / (-u.log()).to(torch.float32)).argmax())


def test_a_seeded_rows_draw_comes_from_the_stream_it_is_asked_for() -> None:
    from mechserve.executor.sampling import STREAM_DRAFT, STREAM_SAMPLE

    probs = torch.full((1, 500), 1.0 / 500)
    row = Row(SamplingParams(temperature=1.0, seed=11), 4)
    draft = Sampler(seed=0).draw(probs.clone(), [row], STREAM_DRAFT)
    sample = Sampler(seed=0).draw(probs.clone(), [row])
    assert draft == [race(probs[0], 11, STREAM_DRAFT, 4)] and sample == [race(probs[0], 11, STREAM_SAMPLE, 4)]
    assert draft != sample


def test_unseeded_rows_draw_as_if_their_seeded_batchmates_were_not_there() -> None:
    """The shared generator's draws go to the unseeded rows in row order, one row of V uniforms each: a seeded
    row in the batch takes none of them (its own stream), so the unseeded rows' ids are those of a batch
    without it."""
    probs = torch.full((3, 500), 1.0 / 500)
    plain, seeded = Row(SamplingParams(temperature=1.0), 0), Row(SamplingParams(temperature=1.0, seed=3), 0)
    alone = Sampler(seed=8).draw(probs[:2].clone(), [plain, plain])
    mixed = Sampler(seed=8).draw(probs.clone(), [seeded, plain, plain])
    assert mixed[1:] == alone and alone[0] != alone[1]
    assert mixed[0] == race(probs[0], 3, 0, 0)
    again = Sampler(seed=8).draw(probs.clone(), [plain, seeded, plain])
    assert [again[0], again[2]] == alone
