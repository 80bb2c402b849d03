"""The governor chooses per request (m16's draft limits): its choices on hand-made candidates, and an
engine on a tiny model where one request's guesses pay and its batchmates' do not."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiny_checkpoints import Tiny, random_prompts

from executor.test_spec_decode import drain, loaded
from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.executor.governor import Candidate, Governor
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model.llama import LlamaModel


def test_a_long_match_beside_seven_with_none_drafts_alone() -> None:
    g = Governor()
    long = Candidate(4, 4, 0.9)
    none = [Candidate(4, 0, 0.5) for _ in range(7)]
    k, limits = g.decide([long, *none], 4)
    assert k == 4 and limits == [None] + [0] * 7
    # the rows counted are 1 + g_i per request: 1 + 4 for the long match, 1 for each of the seven
    tokens = sum(0.9**j for j in range(5)) + 7
    assert g.rate([long, *none], 4) == tokens / g.costs.step(5 + 7)
    # one spec_len for all would have priced 7 padded windows of 4 rows more
    assert g.rate([long, *none], 4) > tokens / g.costs.step(8 * 5)


def test_a_short_proposal_is_limited_to_what_the_proposer_has() -> None:
    k, limits = Governor().decide([Candidate(4, 4, 0.9), Candidate(4, 2, 0.9), Candidate(4, 4, 0.9)], 4)
    assert k == 4 and limits == [None, 2, None]


def test_a_request_whose_guesses_do_not_pay_is_limited_to_0() -> None:
    # at a batch where rows cost, a low-alpha request is dropped, the high-alpha ones keep drafting
    g = Governor(row_cost=0.2, jump_cost=0.0)
    good = [Candidate(3, 3, 0.95), Candidate(3, 3, 0.95)]
    bad = Candidate(3, 3, 0.05)
    k, limits = g.decide([*good, bad], 3)
    assert k > 0 and limits == [None, None, 0]
    assert g.rate([*good, bad], k, frozenset({2})) > g.rate([*good, bad], k)
    # a draft model (available = cap) with every request worth its guesses: no limit, as before m16
    k2, limits2 = Governor().decide([Candidate(3, 3, 0.9)] * 3, 3)
    assert k2 == 3 and limits2 == [None] * 3
    # nothing pays: no speculation and no limits
    assert Governor().decide([Candidate(3, 0, 0.5)] * 4, 3) == (0, [None] * 4)
    assert Governor().choose([Candidate(3, 3, 0.9)], 3) == 3


class OneSpecLen(Governor):
    """m15's governor: the same spec_len, no per-request limits (the rows it counts differ, the k does not
    matter here: it is the windows' padding that is compared)."""

    def decide(self, candidates: Sequence[Candidate], max_k: int) -> tuple[int, list[int | None]]:
        k, _ = super().decide(candidates, max_k)
        return k, [None] * len(candidates)


def run(model: LlamaModel, prompts: Sequence[Sequence[int]], governor: Governor | None) -> tuple[list[Any], Any]:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4) if governor else None
    config = EngineConfig(page_size=4, num_pages=128, speculative=spec)
    executor = None
    if spec is not None:
        executor = TorchExecutor(model, config.num_pages, config.page_size, speculative=spec, governor=governor)
    core = EngineCore(loaded(model, Path("/nonexistent")), config, executor=executor)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [core.add_request(p, params) for p in prompts]
    outs = drain(core)
    core.check_pages()
    done = {o.request_id: list(o.outputs[0].token_ids) for out in outs for o in out.finished}
    return [done[i] for i in ids], ([out.record for out in outs], core.executor.stats())


def test_prompt_lookup_at_batch_4_drafts_only_where_it_has_guesses(tiny: Tiny) -> None:
    """One request repeats its text, three do not: greedy output as without speculation, and fewer target
    rows than with one spec_len for all."""
    model = tiny.model
    prompts = [[*p, *p, *p] for p in random_prompts([5], seed=11)] + random_prompts([9, 8, 10], seed=3)
    plain, _ = run(model, prompts, None)
    limited, (recs, stats) = run(model, prompts, Governor())
    uniform, (_, stats_uniform) = run(model, prompts, OneSpecLen())
    assert limited == plain == uniform
    assert stats.rows < stats_uniform.rows
    assert stats.slots - stats.proposed < stats_uniform.slots - stats_uniform.proposed  # fewer pads
    assert any(d > 0 for rec in recs for d in rec.drafted.values())  # it did speculate
