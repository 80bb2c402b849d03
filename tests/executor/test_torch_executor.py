"""The torch executor at the boundary, the paged KV layout and the prompt-lookup proposer."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from engine_runs import run_engine as generate
from tiny_checkpoints import VOCAB, Tiny, hf_greedy, random_prompts

from mechserve.api.config import EngineConfig
from mechserve.executor.proposers import propose_ngram
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.kv.paged import PagedKVCache, Span, build_attention_batch
from mechserve.spec import m11_parallelism as m11


def item(rid: str, ids: list[int], start: int, n: int, table: list[int], ps: int, **kw: object) -> m11.PlanItem:
    placements = tuple((p, table[p // ps], p % ps) for p in range(start, start + n))
    fields: dict[str, object] = dict(draft_len=0, decode=False, sample=False, generated=0)
    fields.update(kw)
    return m11.PlanItem(rid, start, n, placements=placements, token_ids=tuple(ids), page_table=tuple(table), **fields)  # type: ignore[arg-type]


def test_outcomes_echo_the_plan(tiny: Tiny) -> None:
    a, b = random_prompts([10, 6])
    ex = TorchExecutor(tiny.model, num_pages=8, page_size=4)
    plan = (
        item("a", a[:8], 0, 8, [3, 1], 4),
        item("b", b, 0, 6, [0, 6], 4, sample=True),
    )
    outs = ex.execute(plan)
    assert [o.request_id for o in outs] == ["a", "b"]
    for it, out in zip(plan, outs):
        assert out.start_position == it.start_position
        assert out.executed_tokens == it.num_tokens
        assert out.writes == it.placements
        assert out.accepted_draft_tokens == 0
    assert outs[0].token_ids == ()
    assert list(outs[1].token_ids) == hf_greedy(tiny.hf, b, 1)
    assert ex.execute(()) == ()


def test_malformed_items_are_refused(tiny: Tiny) -> None:
    (a,) = random_prompts([6])
    ex = TorchExecutor(tiny.model, num_pages=4, page_size=2)
    short = dataclasses.replace(item("a", a, 0, 6, [0, 1, 2], 2, sample=True), page_table=(0, 1))
    with pytest.raises(ValueError, match="page table does not back position 5"):
        ex.execute((short,))
    with pytest.raises(ValueError, match="0 known id"):
        ex.execute((item("a", [], 0, 2, [0], 2),))


def test_writes_land_in_the_planned_slots(tiny: Tiny) -> None:
    (a,) = random_prompts([5])
    ex = TorchExecutor(tiny.model, num_pages=4, page_size=2)
    ex.execute((item("a", a, 0, 5, [2, 0, 3], 2, sample=True),))
    k = ex.cache.k[0]  # [num_pages, page_size, KV, D]
    written = {(2, 0), (2, 1), (0, 0), (0, 1), (3, 0)}
    for page in range(4):
        for off in range(2):
            assert bool(k[page, off].abs().sum() > 0) == ((page, off) in written)


@pytest.mark.parametrize(("wrong_at", "accepted"), [(None, 3), (1, 1), (0, 0)])
def test_decode_window_verdict_and_history(tiny: Tiny, wrong_at: int | None, accepted: int) -> None:
    """A decode window of 3 guesses: the verdict accepts exactly the leading guesses that equal the
    argmax, appends them and the target's id at the first mismatch (or the bonus id), and the history
    follows."""
    (a,) = random_prompts([6])
    want = hf_greedy(tiny.hf, a, 5)
    guesses = list(want[1:4])
    if wrong_at is not None:
        guesses[wrong_at] = (guesses[wrong_at] + 1) % VOCAB
    ex = TorchExecutor(tiny.model, num_pages=8, page_size=4, proposer=lambda history, num: guesses[:num])
    (out,) = ex.execute((item("a", a, 0, 6, [0, 1], 4, sample=True),))
    assert list(out.token_ids) == want[:1]
    window = item("a", want[:1], 6, 4, [0, 1, 2], 4, sample=True, decode=True, draft_len=3, generated=1)
    (out,) = ex.execute((window,))
    assert out.accepted_draft_tokens == accepted
    assert list(out.token_ids) == want[1 : 2 + accepted]  # accepted guesses, then the target's own id
    assert ex.history("a") == a + want[: 2 + accepted]


def test_prefix_hit_without_registration(tiny: Tiny) -> None:
    """Plans that start mid-prompt (a cache hit) on an executor that never saw the prompt."""
    (common,) = random_prompts([16], seed=21)
    prompts = [common + t for t in random_prompts([3, 2, 5], seed=22)]
    requests = [m11.Request(f"r{i}", p, 10, arrival_step=2 * i) for i, p in enumerate(prompts)]
    ex = TorchExecutor(tiny.model, num_pages=32, page_size=4)
    engine = m11.Engine(requests, 64, 4, 32, spec_len=2, executors=[ex], eos_token_ids=())
    records = engine.run()
    assert sum(sum(r.reused.values()) for r in records) >= 2 * 16
    assert ex.history("r2")[:16] == [-1] * 16
    for r, p in zip(requests, prompts):
        assert r.output_ids == hf_greedy(tiny.hf, p, 10)


def test_generate_releases_finished_requests(tiny: Tiny) -> None:
    result = generate(tiny.model, random_prompts([4, 5]), 3, config=EngineConfig(page_size=2))
    assert [c.finish_reason for c in result.completions] == ["LENGTH", "LENGTH"]
    assert all(len(c.token_ids) == 3 for c in result.completions)


def test_propose_ngram() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose_ngram([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the most recent match wins
    assert propose_ngram([4, 1, 7, 1, 2, 3, 1], 2) == [2, 3]  # longest suffix first, then shorter
    assert propose_ngram([1, 2, 3], 2) == [3, 3]  # no match: filler
    assert propose_ngram([-1, -1, 4, 2, 4], 3) == [2, 4, 4]  # short follow-up padded
    assert propose_ngram([-1, 4, -1, 4], 1) == [4]  # an unknown follower is never proposed
    assert propose_ngram([7], 0) == []


def test_paged_cache_layout() -> None:
    cache = PagedKVCache(num_layers=2, num_pages=3, page_size=4, num_kv_heads=2, head_dim=5)
    assert cache.k.shape == (2, 3, 4, 2, 5)
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    cache.write(1, torch.tensor([9, 2, 4]), k, v)  # slot = page * page_size + offset
    torch.testing.assert_close(cache.k[1, 2, 1], k[0])
    torch.testing.assert_close(cache.k[1, 0, 2], k[1])
    torch.testing.assert_close(cache.v[1, 1, 0], v[2])
    assert cache.k[0].abs().sum() == 0
    gk, gv = cache.gather(1, torch.tensor([4, 9]))
    torch.testing.assert_close(gk, k[[2, 0]])
    torch.testing.assert_close(gv, v[[2, 0]])


def test_attention_groups_bucket_by_query_length() -> None:
    decodes = [Span(i, 10 + i, 1, [i, 4 + i, 8 + i]) for i in range(4)]
    batch = build_attention_batch(decodes, list(range(4)), 4, group_size=2, native=False)
    assert len(batch.groups) == 1 and batch.groups[0].rows is None  # already flat: no gather, no scatter
    mixed = [Span(0, 0, 9, [0, 1, 2]), Span(9, 5, 1, [3, 4]), Span(10, 2, 3, [5]), Span(13, 7, 2, [6, 7])]
    batch = build_attention_batch(mixed, list(range(15)), 4, group_size=2, sliding_windows=(None, 3), native=False)
    assert sorted(g.q_len for g in batch.groups) == [1, 2, 3, 9]
    assert sum(int(g.dst.numel()) if g.dst is not None else g.batch * g.q_len for g in batch.groups) == 15
    (long_group,) = [g for g in batch.groups if g.q_len == 9]
    full, window = long_group.masks[None], long_group.masks[3]
    assert full.shape == (1, 1, 2 * 9, 9)
    assert full[0, 0, 4].tolist() == [True] * 5 + [False] * 4  # query at position 4 sees 0..4
    assert window[0, 0, 4].tolist() == [False, False, True, True, True] + [False] * 4


def test_a_pool_of_no_pages_or_empty_pages_is_refused_and_one_page_of_one_slot_is_not() -> None:
    for pages, size in ((0, 4), (3, 0), (-1, 4), (3, -2)):
        with pytest.raises(ValueError, match=r"^num_pages and page_size must be > 0$"):
            PagedKVCache(num_layers=1, num_pages=pages, page_size=size, num_kv_heads=1, head_dim=2)
    cache = PagedKVCache(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=2)
    assert (cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim) == (1, 1, 1, 2)
    assert cache.k.shape == (1, 1, 1, 1, 2)


def test_a_pool_is_zeroed_pages_of_its_dtype_on_its_device_the_cpus_on_huge_pages() -> None:
    """Mutation testing (docs/mutation.md): only float32 pools on the CPU were built in the selection. On the CPU a
    pool of at least a huge page starts on one (``huge_zeros``: attention streams the pages); on another device
    (``meta``: no storage, so no accelerator is needed) K, V and what a gather returns are that device's."""
    from mechserve.native.memory import HUGE_PAGE

    cpu = PagedKVCache(num_layers=2, num_pages=300, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert cpu.k.nbytes >= HUGE_PAGE
    for t in (cpu.k, cpu.v):
        assert (t.device.type, t.dtype, t.shape) == ("cpu", torch.bfloat16, (2, 300, 16, 2, 64)) and not t.any()
        assert t.data_ptr() % HUGE_PAGE == 0
    assert cpu.k.data_ptr() != cpu.v.data_ptr()
    meta = torch.device("meta")
    pool = PagedKVCache(2, 3, 4, 2, 5, torch.bfloat16, device=meta)
    for t in (pool.k, pool.v, *pool.flat(1)):
        assert (t.device, t.dtype) == (meta, torch.bfloat16)
    assert pool.k.shape == pool.v.shape == (2, 3, 4, 2, 5) and pool.flat(1)[1].shape == (12, 2, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the workspace views have the gather's shape: torch resizes nothing
        k, v = pool.gather(1, torch.tensor([4, 9, 0], device=meta))
        assert (k.device, k.dtype, k.shape) == (v.device, v.dtype, v.shape) == (meta, torch.bfloat16, (3, 2, 5))
        cpu.write(1, torch.tensor([5, 17]), torch.ones(2, 2, 64), torch.full((2, 2, 64), 2.0))
        k, v = cpu.gather(1, torch.tensor([17, 3]))
    assert k.shape == v.shape == (2, 2, 64) and k[0].eq(1).all() and v[0].eq(2).all() and not k[1].any()
