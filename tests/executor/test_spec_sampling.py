"""Rejection sampling with a draft distribution (Leviathan et al. 2023; Chen et al. 2023): what it emits is the target's distribution.

Unit level: ``verify_draft`` over fixed ``p`` and ``q`` (equal, point masses, disjoint supports,
random), one and two guesses per window, chi-square against ``p`` at a fixed seed.  End to end: a
small-vocabulary model sampled through the m12 engine with a draft model of other weights; the joint
distribution of the emitted ids matches the target model's own (temperature and top-k applied to
both).  Seeded draft sampling is reproducible.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import tiny_config

from mechserve.api.config import SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Sampler
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.executor.verify import verify_draft
from mechserve.model.checkpoint import Checkpoint
from mechserve.model.llama import LlamaModel
from mechserve.model.loader import model_from_checkpoint
from mechserve.spec import m16_request_draft_lengths as m16


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chi_square_p(observed: Counter[object], expected: dict[object, float]) -> float:
    """The p-value of Pearson's chi-square test, cells with expected count < 5 pooled into one.

    Wilson–Hilferty's normal approximation of the chi-square tail (ample for a 1e-3 threshold).
    """
    n = sum(observed.values())
    assert set(observed) <= {c for c, p in expected.items() if p > 0}, "an impossible outcome was emitted"
    stat, cells, pooled_o, pooled_e = 0.0, 0, 0.0, 0.0
    for cell, p in expected.items():
        e = n * p
        if e < 5:
            pooled_o, pooled_e = pooled_o + observed.get(cell, 0), pooled_e + e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    k = cells - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def emit(p: torch.Tensor, q: torch.Tensor, k: int, g: torch.Generator) -> list[int]:
    """``len(p) - 1`` ids by speculative sampling: ``p``/``q`` [n + 1, V] fix each token index's
    distributions; windows of up to ``k`` guesses drawn from ``q``, verified by ``verify_draft``."""
    n = p.shape[0] - 1
    out: list[int] = []
    while len(out) < n:
        i = len(out)
        guesses = [int(torch.multinomial(q[i + j], 1, generator=g)) for j in range(min(k, n - i))]
        u = torch.rand(len(guesses), generator=g, dtype=torch.float64).tolist()
        a, dist = verify_draft(p[i : i + len(guesses) + 1], q[i : i + len(guesses)], guesses, u)
        out += [*guesses[:a], int(torch.multinomial(dist, 1, generator=g))]
    return out[:n]


V = 6


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


def random_dist(seed: int, zeros: Sequence[int] = ()) -> torch.Tensor:
    t = torch.rand(V, generator=torch.Generator().manual_seed(seed)) + 0.05
    t[list(zeros)] = 0
    return t / t.sum()


PAIRS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
    "q-equals-p": (dist(5, 1, 1, 2, 0, 1), dist(5, 1, 1, 2, 0, 1)),
    "q-point-mass-likely": (dist(5, 1, 1, 2, 0, 1), dist(1, 0, 0, 0, 0, 0)),
    "q-point-mass-impossible": (dist(5, 1, 1, 2, 0, 1), dist(0, 0, 0, 0, 1, 0)),
    "disjoint-supports": (dist(3, 1, 0, 0, 0, 2), dist(0, 0, 1, 4, 2, 0)),
    "random": (random_dist(1), random_dist(2)),
    "q-misses-mass": (random_dist(3), random_dist(4, zeros=[0, 1])),
    "p-sparse-q-flat": (random_dist(5, zeros=[2, 3, 4]), dist(1, 1, 1, 1, 1, 1)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_one_guess_emits_p(name: str) -> None:
    p, q = PAIRS[name]
    g = torch.Generator().manual_seed(7)
    bonus = dist(1, 1, 1, 1, 1, 1)
    n = 6000
    seen = Counter(emit(torch.stack([p, bonus]), torch.stack([q, bonus]), 1, g)[0] for _ in range(n))
    assert chi_square_p(seen, dict(enumerate(p.tolist()))) > 1e-3, (name, seen)


@pytest.mark.parametrize("name", ["random", "disjoint-supports", "q-point-mass-likely"])
def test_two_guesses_emit_the_joint_of_p(name: str) -> None:
    """Windows of two guesses: the pair of emitted ids is distributed as p0 x p1 (p fixed per index)."""
    p0, q0 = PAIRS[name]
    p1, q1 = random_dist(11), random_dist(12)
    p = torch.stack([p0, p1, dist(1, 1, 1, 1, 1, 1)])
    q = torch.stack([q0, q1, dist(1, 1, 1, 1, 1, 1)])
    g = torch.Generator().manual_seed(8)
    seen = Counter(tuple(emit(p, q, 2, g)) for _ in range(6000))
    want = {(a, b): float(p0[a] * p1[b]) for a, b in itertools.product(range(V), range(V))}
    assert chi_square_p(seen, want) > 1e-3, seen


@pytest.mark.parametrize("name", ["random", "q-equals-p", "p-sparse-q-flat"])
def test_the_bonus_token_is_distributed_as_p(name: str) -> None:
    """After a window whose every guess was accepted, the next id (the bonus token) is drawn from the
    target's distribution at the row after the last guess, not from q or a residual."""
    p0, q0 = PAIRS[name]
    p1, q1 = random_dist(21), random_dist(22)
    bonus = random_dist(23, zeros=[1])
    p, q = torch.stack([p0, p1, bonus]), torch.stack([q0, q1])
    g = torch.Generator().manual_seed(9)
    seen: Counter[int] = Counter()
    while sum(seen.values()) < 4000:
        guesses = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        u = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        a, nxt = verify_draft(p, q, guesses, u)
        if a == 2:
            seen[int(torch.multinomial(nxt, 1, generator=g))] += 1
    assert seen[1] == 0  # the bonus row's zero is honoured
    assert chi_square_p(seen, dict(enumerate(bonus.tolist()))) > 1e-3, (name, seen)


def test_the_verdict_itself() -> None:
    p, q = dist(1, 0, 0, 0, 0, 0), dist(0.5, 0.5, 0, 0, 0, 0)
    bonus = dist(0, 0, 0, 0, 0, 1)
    pp, qq = torch.stack([p, bonus]), q.unsqueeze(0)
    assert verify_draft(pp, qq, [0], [0.999])[0] == 1  # p(g) >= q(g): always accepted
    a, residual = verify_draft(pp, qq, [1], [0.0])  # p(g) == 0: never accepted
    assert a == 0 and residual.tolist() == pytest.approx([0.5, 0, 0, 0, 0, 0])
    a, rest = verify_draft(pp, qq, [0], [0.3])
    assert a == 1 and torch.equal(rest, pp[1])  # all accepted: the bonus row
    assert verify_draft(pp, qq[:0], [], [])[0] == 0


def test_the_verdict_normalises_each_row_and_falls_back_to_p() -> None:
    """Mutation testing (docs/mutation.md): rows scaled differently give the verdict of the normalised rows;
    no guess is the whole ``p[0]``; a rejection whose residual is empty draws from ``p`` itself."""
    p, q = dist(0.2, 0.8, 0, 0, 0, 0), dist(0.4, 0.6, 0, 0, 0, 0)
    bonus = dist(0, 0, 0, 0, 0, 1)
    for p_scale, q_scale in ((1.0, 1.0), (4.0, 1.0), (1.0, 4.0), (0.25, 3.0)):
        pp, qq = torch.stack([p * p_scale, bonus]), (q * q_scale).unsqueeze(0)
        # guess 0: p/q = 0.5, accepted iff u < 0.5, else the residual max(0, p - q) = (0, 0.2) (normalised rows)
        assert verify_draft(pp, qq, [0], [0.49])[0] == 1, (p_scale, q_scale)
        a, residual = verify_draft(pp, qq, [0], [0.51])
        assert a == 0 and residual.tolist() == pytest.approx([0, 0.2, 0, 0, 0, 0], abs=1e-6), (p_scale, q_scale)
    a, first = verify_draft(torch.stack([p, bonus]), q[None, :0].reshape(0, 6), [], [])
    assert a == 0 and torch.equal(first, p)  # no guess: the next id is drawn from p's first row
    # p == q: u = 1 (the edge rounding reaches) rejects with an all-zero residual, so p's row is drawn from
    a, fallback = verify_draft(torch.stack([p, bonus]), p.unsqueeze(0), [1], [1.0])
    assert a == 0 and fallback.tolist() == pytest.approx(p.tolist())


# End to end through the engine ----------------------------------------------------------------------------------

SMALL_V = 5
PROMPT = [1, 3, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=4, max_tokens=4, ignore_eos=True)


def small_model(layers: int, seed: int) -> tuple[LlamaModel, object]:
    from transformers import AutoModelForCausalLM

    config = tiny_config(vocab_size=SMALL_V, num_hidden_layers=layers, initializer_range=0.08)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config).eval()
    tensors = {name: t.detach().clone() for name, t in hf.state_dict().items()}
    return model_from_checkpoint(Checkpoint(Path(f"<small {seed}>"), config, tensors)), hf


def target_joint(hf: object, params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation of ``PROMPT`` of length ``n`` under the processed distribution."""
    sampler = Sampler(seed=0)
    from mechserve.executor.sampling import Row

    def probs(prefix: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            logits = hf(torch.tensor([[*PROMPT, *prefix]])).logits[0, -1:].float()  # type: ignore[operator]
        p = sampler.probs(logits, [Row(params, len(prefix))])[0]
        return (p / p.sum()).tolist()

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, w in joint.items():
            for t, pt in enumerate(probs(prefix)):
                nxt[(*prefix, t)] = w * pt
        joint = nxt
    return joint


def sample_engine(
    model: LlamaModel, draft: LlamaModel | None, n: int, params: SamplingParams, spec_len: int, seed: int = 3
) -> list[list[int]]:
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=spec_len, draft_model="x", adaptive=False)
    ex = TorchExecutor(model, n + 1, 8, sampler=Sampler(seed), speculative=spec if draft else None, draft_model=draft)
    requests = []
    for i in range(n):
        ex.add_request(ExecutorRequest(f"r{i}", PROMPT, params))
        requests.append(m16.Request(f"r{i}", list(PROMPT), params.max_tokens))
    m16.Engine(requests, 1 << 20, 8, n + 1, spec_len=spec_len if draft else 0, executors=[ex], eos_token_ids=()).run()
    return [list(r.output_ids) for r in requests]


@pytest.fixture(scope="module")
def small() -> tuple[LlamaModel, object, LlamaModel]:
    model, hf = small_model(2, seed=0)
    draft, _ = small_model(1, seed=5)  # other weights: q differs from p, guesses are often rejected
    return model, hf, draft


def test_engine_with_a_draft_model_samples_the_target_distribution(
    small: tuple[LlamaModel, object, LlamaModel],
) -> None:
    """4 tokens per request, spec_len 2 (windows of 2 guesses then 1): the joint of the first three ids
    and the marginal of the fourth match the target's own distribution."""
    model, hf, draft = small
    runs = sample_engine(model, draft, 3000, PARAMS, spec_len=2)
    joint = target_joint(hf, PARAMS, 4)
    first3: dict[object, float] = Counter()
    last: dict[object, float] = Counter()
    for seq, w in joint.items():
        first3[seq[:3]] += w
        last[seq[3]] += w
    assert chi_square_p(Counter(tuple(r[:3]) for r in runs), dict(first3)) > 1e-3
    assert chi_square_p(Counter(r[3] for r in runs), dict(last)) > 1e-3


def test_the_draft_really_was_rejected_and_accepted(small: tuple[LlamaModel, object, LlamaModel]) -> None:
    model, _, draft = small
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_model="x", adaptive=False)
    ex = TorchExecutor(model, 64, 8, sampler=Sampler(1), speculative=spec, draft_model=draft)
    requests = [m16.Request(f"r{i}", list(PROMPT), 4) for i in range(40)]
    for r in requests:
        ex.add_request(ExecutorRequest(r.request_id, PROMPT, PARAMS))
    m16.Engine(requests, 1 << 20, 8, 64, spec_len=2, executors=[ex], eos_token_ids=()).run(
        lambda record: ex.settle(record.accepted)
    )
    assert 0 < ex.stats().accepted < ex.stats().proposed


def seeded_runs(model: LlamaModel, draft: LlamaModel, seeds: Sequence[int]) -> Callable[[], list[list[int]]]:
    def once() -> list[list[int]]:
        spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="x", adaptive=False)
        ex = TorchExecutor(model, 64, 4, sampler=Sampler(None), speculative=spec, draft_model=draft)
        requests = []
        for s in seeds:
            params = SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True, logprobs=1)
            ex.add_request(ExecutorRequest(f"s{s}", PROMPT, params))
            requests.append(m16.Request(f"s{s}", list(PROMPT), 10))
        logprobs: dict[str, list[int]] = {r.request_id: [] for r in requests}

        def on_step(record: m16.StepRecord) -> None:
            for rid, ids in record.tokens.items():
                logprobs[rid] += [lp.token_id for lp in ex.take_logprobs(rid)][: len(ids)]

        m16.Engine(requests, 64, 4, 64, spec_len=3, executors=[ex], eos_token_ids=()).run(on_step)
        assert all(logprobs[r.request_id] == r.output_ids for r in requests)
        return [list(r.output_ids) for r in requests]

    return once


def test_seeded_draft_sampling_is_reproducible(small: tuple[LlamaModel, object, LlamaModel]) -> None:
    """Same seeds, same configuration: the same ids, whatever the unseeded generator does; logprobs follow
    the emitted ids (residual and bonus draws included)."""
    model, _, draft = small
    once = seeded_runs(model, draft, [1, 2, 3])
    first = once()
    assert once() == first
    assert seeded_runs(model, draft, [4, 2, 3])()[1:] == first[1:]  # batchmates' seeds do not matter here
    assert len({tuple(x) for x in first}) > 1


def test_engine_with_suffix_decoding_samples_the_target_distribution(
    small: tuple[LlamaModel, object, LlamaModel],
) -> None:
    """Suffix decoding's guesses are point masses from the other requests' outputs (the global tree, grown as
    they generate): verified exactly, the joint of the first three ids and the marginal of the fourth are the
    target's own, and some guesses really were accepted and some rejected."""
    model, hf, _ = small
    n = 3000
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=2, adaptive=False)
    ex = TorchExecutor(model, n + 1, 8, sampler=Sampler(3), speculative=spec)
    requests = []
    for i in range(n):
        ex.add_request(ExecutorRequest(f"r{i}", PROMPT, PARAMS))
        requests.append(m16.Request(f"r{i}", list(PROMPT), PARAMS.max_tokens))
    m16.Engine(requests, 1 << 20, 8, n + 1, spec_len=2, executors=[ex], eos_token_ids=()).run(
        lambda record: ex.settle(record.accepted)
    )
    runs = [list(r.output_ids) for r in requests]
    joint = target_joint(hf, PARAMS, 4)
    first3: dict[object, float] = Counter()
    last: dict[object, float] = Counter()
    for seq, w in joint.items():
        first3[seq[:3]] += w
        last[seq[3]] += w
    assert chi_square_p(Counter(tuple(r[:3]) for r in runs), dict(first3)) > 1e-3
    assert chi_square_p(Counter(r[3] for r in runs), dict(last)) > 1e-3
    assert 0 < ex.stats().accepted < ex.stats().proposed
