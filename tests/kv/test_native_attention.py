"""The native paged-attention kernel against torch's gather-then-SDPA path (the reference).

The kernel must be built here: CI has a compiler, and a kernel that silently fell back to torch
would hide a broken build, so nothing in this file skips.
"""

from __future__ import annotations

import ctypes
import dataclasses
from contextlib import contextmanager
from functools import cache
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_builds import ARCHS

from mechserve.api.errors import NativeKernelError
from mechserve.kv import native
from mechserve.kv.paged import PagedKVCache, Span, build_attention_batch, paged_attention
from mechserve.native.build import compiler

# This machine's build and every portable one it can run (native_builds.ARCHS): AVX-512 without BF16 (the
# vector path on bfloat16 pages without VDPBF16PS), and the portable loops (AVX2, the baseline ISA).


@cache
def build(arch: str) -> ctypes.CDLL:
    """The kernel built for ``arch`` (this machine's build for ``native``)."""
    if arch == "native":
        return native._load()
    return native.bind(dataclasses.replace(native.KERNEL, arch=arch).load())


@contextmanager
def using(arch: str):
    """The attention calls inside the block run on the ``arch`` build."""
    lib = build(arch)
    with mock.patch.object(native, "_load", lambda: lib):
        yield lib


def test_kernel_builds_and_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MECHSERVE_ATTENTION", "native")
    native.enabled.cache_clear()
    try:
        assert native.enabled()
        assert native.build().exists()
        monkeypatch.delenv("MECHSERVE_ATTENTION")
        native.enabled.cache_clear()
        assert native.enabled()  # auto picks the kernel when it builds
    finally:
        native.enabled.cache_clear()


def test_torch_mode_and_bad_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("MECHSERVE_ATTENTION", "torch")
        native.enabled.cache_clear()
        assert not native.enabled()
        monkeypatch.setenv("MECHSERVE_ATTENTION", "cuda")
        native.enabled.cache_clear()
        with pytest.raises(ValueError, match="MECHSERVE_ATTENTION must be one of auto, native, torch"):
            native.enabled()
    finally:
        native.enabled.cache_clear()


def test_native_mode_without_a_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))  # no build cached there
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NativeKernelError, match="no C\\+\\+ compiler found"):
        native.build()


def test_a_corrupt_cached_library_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))
    native._load.cache_clear()
    try:
        path = native.build()
        path.write_bytes(b"")  # an interrupted copy, say
        native._load.cache_clear()
        assert native._load().mechserve_paged_attention_abi() == native.ABI
        assert path.stat().st_size > 0 and path.stat().st_mode & 0o005  # rebuilt, and loadable by others
    finally:
        native._load.cache_clear()


def test_cxx_may_carry_words_but_must_name_a_program(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "g++ -Wall")
    assert compiler() == ["g++", "-Wall"]
    assert native.build().exists()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(NativeKernelError, match="does not name an executable"):
        native.build()
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(NativeKernelError, match=r"failed to build paged_attention.cpp \(exit 1\): no message"):
        native.build()


def test_every_item_goes_to_the_kernel_when_it_is_on() -> None:
    spans = [Span(0, 0, 20, [0, 1, 2, 3, 4]), Span(20, 7, 1, [5, 6]), Span(21, 3, 4, [7, 8])]
    batch = build_attention_batch(spans, list(range(25)), 4, group_size=2, native=True)
    assert batch.native is not None
    # row, start, length, table offset
    assert batch.native.items.tolist() == [[0, 0, 20, 0], [20, 7, 1, 5], [21, 3, 4, 7]]
    assert batch.native.tables.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # only the pages the items reach
    assert batch.groups == ()
    off = build_attention_batch(spans, list(range(25)), 4, group_size=2, native=False)
    assert off.native is None and sorted(g.q_len for g in off.groups) == [1, 4, 20]


def test_rejects_what_it_cannot_handle() -> None:
    q = torch.zeros(1, 2, 8, dtype=torch.float16)
    pool = torch.zeros(4, 1, 8, dtype=torch.float16)
    items, tables = torch.tensor([[0, 0, 1, 0]]), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.paged_attention(q, pool, pool, torch.zeros(1, 16, dtype=torch.float16), items, tables, 4, 1.0, None)
    q32, pool32 = torch.zeros(2, 8, 2).transpose(1, 2), pool.float()  # [2, 2, 8], not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        native.paged_attention(q32, pool32, pool32, torch.zeros(2, 16), items, tables, 4, 1.0, None)


def test_the_step_rows_are_written_with_their_slots_checked() -> None:
    """The kernel stores the step's K/V before it attends; a slot outside the pool (or rows of another
    dtype) is refused with nothing written, never a write past the pool."""
    q, out = torch.ones(1, 2, 8), torch.zeros(1, 16)
    pool_k, pool_v = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    items, tables = torch.tensor([[0, 2, 1, 0]]), torch.tensor([0], dtype=torch.int32)
    k_new, v_new = torch.full((1, 1, 8), 2.0), torch.full((1, 1, 8), 3.0)
    native.paged_attention(q, pool_k, pool_v, out, items, tables, 4, 1.0, None, (k_new, v_new, torch.tensor([2])))
    assert pool_k[2].eq(2.0).all() and pool_v[2].eq(3.0).all() and pool_k[:2].eq(0).all()
    # position 2 sees rows 0-2; its own K (q . k = 16 against 0) carries the softmax, so out is ~its V
    torch.testing.assert_close(out, torch.full((1, 16), 3.0), atol=1e-5, rtol=0)
    for bad in (4, -1):
        before = pool_k.clone()
        with pytest.raises(ValueError, match="outside the pool's 4 rows"):
            native.paged_attention(
                q, pool_k, pool_v, out, items, tables, 4, 1.0, None, (k_new * 5, v_new, torch.tensor([bad]))
            )
        assert torch.equal(pool_k, before)
    with pytest.raises(ValueError, match="the pool's dtype"):
        native.paged_attention(
            q, pool_k, pool_v, out, items, tables, 4, 1.0, None, (k_new.bfloat16(), v_new, torch.tensor([2]))
        )


def _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window, use_native, scale=None):
    cache = PagedKVCache(1, pool_k.shape[0], page_size, pool_k.shape[2], pool_k.shape[3], pool_k.dtype)
    cache.k[0].copy_(pool_k)
    cache.v[0].copy_(pool_v)
    batch = build_attention_batch(spans, slots, page_size, group, (None, window), native=use_native)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return paged_attention(q, k, v, cache, 0, batch, scale, window), cache


# Head sizes: the vector path's three (32, 64, 128) and others the portable loops take (4, 80).
HEAD_DIMS = [4, 32, 64, 80, 128]


@st.composite
def workloads(draw, many: bool = False):
    """A step's attention: page size, KV heads, GQA group, head size, (first position, query length) per item,
    window, dtype, seed, build and threads.  ``many``: a decode batch of 32 to 80 requests, with up to two
    prefill chunks of up to 300 tokens beside it (a mixed step), instead of up to 6 items of any kind."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    if many:
        decode = draw(st.integers(32, 80))
        chunks = draw(st.lists(st.integers(33, 300), max_size=2))
        lengths = [1] * decode + chunks
        starts = [draw(st.integers(0, 400)) for _ in range(decode)] + [draw(st.integers(0, 64)) for _ in chunks]
    else:
        lengths = draw(st.lists(st.sampled_from([1, 1, 2, 3, 8, 16, 17, 32, 33, 64, 100]), min_size=1, max_size=6))
        starts = [draw(st.integers(0, 60)) for _ in lengths]
    window = draw(st.sampled_from([None, None, 1, 5, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    arch = draw(st.sampled_from(ARCHS))
    # 1 thread: no context splits; 8 on one or two items: eight splits merged (flash-decoding)
    threads = draw(st.sampled_from([1, 2, 3, 8]))
    return page_size, kv, group, head_dim, list(zip(starts, lengths)), window, dtype, seed, arch, threads


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_kernel_matches_the_sdpa_path(w) -> None:
    """Same outputs and same pages written, for any page size, GQA group, head size, mix of decode
    steps / windows / prefill chunks (one task or several blocks of queries), sliding window, dtype and
    thread count (a short item's context split or not); shared (prefix) pages included; in this
    machine's build and its portable ones."""
    _check_against_sdpa(w)


@settings(max_examples=12, deadline=None)
@given(workloads(many=True))
def test_kernel_matches_the_sdpa_path_at_large_decode_batches(w) -> None:
    """The same at the batches the engine runs under load: 32 to 80 decode rows at contexts up to 400,
    with prefill chunks of up to 300 tokens in the same step (the mixed workload's steps)."""
    _check_against_sdpa(w)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scores_match_the_sdpa_path(arch, dtype) -> None:
    """Scores of magnitude ~100 (queries scaled by 20): the vector paths' exp and the running max's large jumps."""
    for seed in range(3):
        _check_against_sdpa((4, 2, 3, 64, [(0, 1), (5, 1), (8, 4), (0, 40)], None, dtype, seed, arch, 2), q_scale=20.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_a_nan_in_a_masked_position_does_not_reach_the_queries_that_cannot_see_it(arch, dtype, head_dim) -> None:
    """A window of 4 guesses whose last V row is NaN (a model gone wrong on one row): the 3 queries before it
    cannot see it and must come out as they would beside a finite row; in every build (the vector paths add
    a block's V rows for all its positions, and 0 * NaN is NaN, so a zero weight must be skipped)."""
    gen = torch.Generator().manual_seed(head_dim)
    page_size, start, n = 4, 8, 4
    table = [2, 0, 1]
    slots = [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]
    spans = [Span(0, start, n, table)]
    pool_k = torch.randn(3, page_size, 1, head_dim, generator=gen).to(dtype)
    pool_v = torch.randn(3, page_size, 1, head_dim, generator=gen).to(dtype)
    q = torch.randn(n, 2, head_dim, generator=gen).to(dtype)
    k = torch.randn(n, 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, 1, head_dim, generator=gen).to(dtype)
    want, _ = _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, 2, None, False)
    v[n - 1, 0, 5] = float("nan")
    with using(arch):
        got, _ = _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, 2, None, True)
    assert torch.isnan(got[n - 1]).any()  # the last query sees it
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got[: n - 1].float(), want[: n - 1].float(), **tol)


def _check_against_sdpa(w, q_scale: float = 1.0) -> None:
    page_size, kv, group, head_dim, items, window, dtype, seed, arch, threads = w
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 + sum(-(-(s + n) // page_size) for s, n in items)
    pages = torch.randperm(num_pages, generator=gen).tolist()
    shared, free = pages[:2], pages[2:]  # a cached prefix of two pages
    spans, slots, row = [], [], 0
    for start, n in items:
        need = -(-(start + n) // page_size)
        if start >= 2 * page_size:  # it only reads the prefix: share it, as prefix caching does
            table = shared + [free.pop() for _ in range(need - 2)]
        else:
            table = [free.pop() for _ in range(need)]
        spans.append(Span(row, start, n, table))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]
        row += n
    pool_k = torch.randn(num_pages, page_size, kv, head_dim, generator=gen).to(dtype)
    pool_v = torch.randn(num_pages, page_size, kv, head_dim, generator=gen).to(dtype)
    q = (torch.randn(row, kv * group, head_dim, generator=gen) * q_scale).to(dtype)
    k = torch.randn(row, kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(row, kv, head_dim, generator=gen).to(dtype)
    ref, ref_cache = _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window, False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with using(arch):
            got, got_cache = _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ref_cache.k, got_cache.k) and torch.equal(ref_cache.v, got_cache.v)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_float16_falls_back_to_sdpa_for_short_items() -> None:
    spans = [Span(0, 5, 1, [0, 1])]
    pool = torch.randn(2, 4, 1, 8).half()
    q, k, v = torch.randn(1, 2, 8).half(), torch.randn(1, 1, 8).half(), torch.randn(1, 1, 8).half()
    got, _ = _attend(spans, [5], q, k, v, pool, pool.clone(), 4, 2, None, True)
    ref, _ = _attend(spans, [5], q, k, v, pool, pool.clone(), 4, 2, None, False)
    torch.testing.assert_close(got, ref)


def _naive(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window, scale=None):
    """Attention written out per query from the definition: the pool with this step's K/V written at ``slots``,
    each query at position p attending to its request's positions <= p (within the window); ``scale`` defaults
    to ``head_dim ** -0.5``."""
    kv, head_dim = pool_k.shape[2], pool_k.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    keys, values = pool_k.reshape(-1, kv, head_dim).clone(), pool_v.reshape(-1, kv, head_dim).clone()
    keys[torch.tensor(slots)], values[torch.tensor(slots)] = k, v
    out = torch.zeros(q.shape[0], q.shape[1] * head_dim)
    for s in spans:
        for i in range(s.num_tokens):
            p = s.start + i
            seen = [x for x in range(p + 1) if window is None or x > p - window]
            where = torch.tensor([s.page_table[x // page_size] * page_size + x % page_size for x in seen])
            for h in range(q.shape[1]):
                scores = keys[where, h // group] @ q[s.row + i, h] * scale
                out[s.row + i, h * head_dim : (h + 1) * head_dim] = torch.softmax(scores, 0) @ values[where, h // group]
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_items_of_different_lengths_in_one_bucket_match_the_definition(window) -> None:
    """Mutation testing (docs/mutation.md): two prefill chunks of 8 and 5 tokens share the 5..8 bucket, so the
    shorter one is padded; a decode step sits in its own bucket; the shorter chunk comes last in the step.
    The SDPA path (the kernel takes items this short; it is checked against this path above)."""
    gen = torch.Generator().manual_seed(20)
    page_size, kv, group, head_dim = 4, 2, 2, 8
    spans = [Span(0, 2, 8, [3, 0, 5]), Span(8, 7, 1, [1, 6]), Span(9, 0, 5, [2, 4])]
    slots = [
        s.page_table[p // page_size] * page_size + p % page_size
        for s in spans
        for p in range(s.start, s.start + s.num_tokens)
    ]
    pool_k, pool_v = (
        torch.randn(7, page_size, kv, head_dim, generator=gen),
        torch.randn(7, page_size, kv, head_dim, generator=gen),
    )
    q = torch.randn(14, kv * group, head_dim, generator=gen)
    k, v = torch.randn(14, kv, head_dim, generator=gen), torch.randn(14, kv, head_dim, generator=gen)
    batch = build_attention_batch(spans, slots, page_size, group, (None, window), native=False)
    assert [g.q_len for g in batch.groups] == [1, 8]  # one bucket holds both chunks
    got, _ = _attend(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window, False)
    torch.testing.assert_close(got, _naive(spans, slots, q, k, v, pool_k, pool_v, page_size, group, window))


def _same_group(moved, group, device: torch.device) -> None:
    """``moved`` is ``group`` on ``device``: the same sizes, the same index tensors (shapes and dtypes; a meta
    tensor holds no values) and one mask per sliding window."""
    assert (moved.batch, moved.q_len, moved.ctx_len) == (group.batch, group.q_len, group.ctx_len)
    for got, want in ((moved.rows, group.rows), (moved.src, group.src), (moved.dst, group.dst)):
        assert (got is None) == (want is None)
        if want is not None:
            assert (got.device, got.shape, got.dtype) == (device, want.shape, want.dtype)
    assert (moved.kv_slots.device, moved.kv_slots.shape) == (device, group.kv_slots.shape)
    assert list(moved.masks) == list(group.masks)
    for w, mask in group.masks.items():
        assert (moved.masks[w].device, moved.masks[w].shape, moved.masks[w].dtype) == (device, mask.shape, mask.dtype)


def test_a_batch_moved_off_the_cpu_carries_its_native_items_as_sdpa_groups() -> None:
    """Mutation testing (docs/mutation.md): ``AttentionBatch.to`` had no test off the CPU. On the CPU it is the
    batch itself; on another device (``meta`` here: tensors without storage, so no accelerator is needed) the
    kernel's items become SDPA groups ahead of the batch's own, and every index tensor and mask moves with them."""
    meta = torch.device("meta")
    # a prefill chunk of 5 (padded in its bucket beside one of 7: rows, src and dst), a decode step, a chunk of 7
    spans = [Span(0, 0, 5, [0, 1]), Span(5, 6, 1, [2, 3]), Span(6, 2, 7, [4, 5, 6])]
    slots = [s.page_table[p // 4] * 4 + p % 4 for s in spans for p in range(s.start, s.start + s.num_tokens)]
    decodes = [Span(i, 9 + i, 1, [i, 3 + i, 6 + i]) for i in range(3)]  # one group, rows 0..2 in order: no rows
    steps = ((spans, slots), (decodes, [0, 1, 2]))
    for native_on, (group_spans, group_slots) in ((on, step) for on in (True, False) for step in steps):
        batch = build_attention_batch(group_spans, group_slots, 4, 2, (None, 3), native=native_on)
        assert batch.to(torch.device("cpu")) is batch
        assert (batch.native is not None) == native_on and (batch.groups == ()) == native_on
        expected = (batch.native_fallback() if native_on else ()) + batch.groups
        # the kernel's items as SDPA groups are exactly the groups of the torch path, the shortcut included
        torch_path = build_attention_batch(group_spans, group_slots, 4, 2, (None, 3), native=False).groups
        for group, want in zip(expected, torch_path, strict=True):
            _same_group(group, want, torch.device("cpu"))
            for got_t, want_t in ((group.rows, want.rows), (group.src, want.src), (group.kv_slots, want.kv_slots)):
                assert got_t is None or torch.equal(got_t, want_t)
            assert all(torch.equal(group.masks[w], mask) for w, mask in want.masks.items())
        moved = batch.to(meta)
        assert moved.native is None and len(moved.groups) == len(expected) > 0
        assert (moved.num_tokens, moved.page_size, moved.group_size, moved.sliding_windows) == (
            batch.num_tokens,
            4,
            2,
            (None, 3),
        )
        assert (moved.slot_mapping.device, moved.slot_mapping.shape, moved.slot_mapping.dtype) == (
            meta,
            (batch.num_tokens,),
            torch.int64,
        )
        for got, group in zip(moved.groups, expected, strict=True):
            _same_group(got, group, meta)
    assert any(g.rows is None for g in build_attention_batch(decodes, [0, 1, 2], 4, 2, native=False).groups)
    assert all(g.rows is not None for g in build_attention_batch(spans, slots, 4, 2, native=False).groups)


def _step(seed: int, dtype: torch.dtype = torch.float32):
    """A step of three items over a pool of 7 pages of 4 slots (2 KV heads, GQA group 2, head size 8): a prefill
    chunk of 8 from position 2, a decode step at 7 and a chunk of 5 from 0; its spans, slots, q, k, v and pool."""
    gen = torch.Generator().manual_seed(seed)
    spans = [Span(0, 2, 8, [3, 0, 5]), Span(8, 7, 1, [1, 6]), Span(9, 0, 5, [2, 4])]
    slots = [s.page_table[p // 4] * 4 + p % 4 for s in spans for p in range(s.start, s.start + s.num_tokens)]
    pool_k, pool_v = (torch.randn(7, 4, 2, 8, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(14, 4, 8, generator=gen)
    k, v = torch.randn(14, 2, 8, generator=gen), torch.randn(14, 2, 8, generator=gen)
    return spans, slots, q, k, v, pool_k, pool_v


def test_the_batch_follows_mechserve_attention_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = [Span(0, 0, 3, [0]), Span(3, 5, 1, [1, 2])]
    try:
        for mode, on in (("native", True), ("torch", False)):
            monkeypatch.setenv("MECHSERVE_ATTENTION", mode)
            native.enabled.cache_clear()
            for given, kernel in ((None, on), (not on, not on)):
                batch = build_attention_batch(spans, [0, 1, 2, 9], 4, 2, native=given)
                assert (batch.native is not None, batch.groups == ()) == (kernel, kernel)
    finally:
        native.enabled.cache_clear()


def test_the_kernel_gets_only_the_pages_its_items_reach() -> None:
    # page tables longer than the step reaches (pages of 4): the first item reaches page 0 of its table, the second
    # positions 5 and 6, pages 0 and 1 of its table
    spans = [Span(0, 0, 3, [4, 5, 6]), Span(3, 5, 2, [1, 2, 3, 7])]
    batch = build_attention_batch(spans, [16, 17, 18, 9, 10], 4, 2, native=True)
    assert batch.native is not None
    assert batch.native.items.tolist() == [[0, 0, 3, 0], [3, 5, 2, 1]]
    assert batch.native.tables.tolist() == [4, 1, 2]


def test_float32_and_bfloat16_are_attended_by_the_kernel_and_other_dtypes_by_sdpa() -> None:
    spans, slots, q, k, v, pool_k, pool_v = _step(3)
    for q_dtype, kv_dtype, kernel in (
        (torch.float32, torch.float32, True),
        (torch.bfloat16, torch.bfloat16, True),
        (torch.float32, torch.bfloat16, False),  # pages of another dtype than the model's (``kv_dtype``)
        (torch.float16, torch.float16, False),
    ):
        with mock.patch.object(native, "paged_attention", wraps=native.paged_attention) as kernel_call:
            qq, kk, vv = (t.to(q_dtype) for t in (q, k, v))
            got, _ = _attend(spans, slots, qq, kk, vv, pool_k.to(kv_dtype), pool_v.to(kv_dtype), 4, 2, None, True)
        assert kernel_call.call_count == int(kernel) and got.dtype == q_dtype, (q_dtype, kv_dtype)


@pytest.mark.parametrize("use_native", [True, False])
def test_pages_of_another_dtype_store_the_step_converted_and_are_attended_in_the_queries_dtype(use_native) -> None:
    """float32 queries over bfloat16 pages (``kv_dtype``): the step's K/V are stored as bfloat16 and the context
    is read back as float32, so the output is the definition's over the rounded pages."""
    spans, slots, q, k, v, pool_k, pool_v = _step(5, torch.bfloat16)
    got, cache = _attend(spans, slots, q, k, v, pool_k, pool_v, 4, 2, None, use_native)
    flat_k, flat_v = cache.flat(0)
    assert torch.equal(flat_k[slots], k.bfloat16()) and torch.equal(flat_v[slots], v.bfloat16())
    rounded = (t.bfloat16().float() for t in (k, v, pool_k, pool_v))
    want = _naive(spans, slots, q, *rounded, 4, 2, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("use_native", [True, False])
def test_attention_uses_the_scale_it_is_given(use_native) -> None:
    """A model's own scale (not always ``head_dim ** -0.5``) reaches both paths."""
    spans, slots, q, k, v, pool_k, pool_v = _step(7)
    for window in (None, 3):
        got, _ = _attend(spans, slots, q, k, v, pool_k, pool_v, 4, 2, window, use_native, scale=0.9)
        torch.testing.assert_close(got, _naive(spans, slots, q, k, v, pool_k, pool_v, 4, 2, window, scale=0.9))


def test_attention_off_the_cpu_returns_its_output_on_the_queries_device() -> None:
    """On another device (``meta``: shapes without storage) the torch path runs with the pool, the batch and the
    output all there."""
    meta = torch.device("meta")
    spans, slots, q, k, v, _, _ = _step(9)
    cache = PagedKVCache(1, 7, 4, 2, 8, device=meta)
    batch = build_attention_batch(spans, slots, 4, 2, (None, 3), native=True).to(meta)
    for window in (None, 3):
        out = paged_attention(q.to(meta), k.to(meta), v.to(meta), cache, 0, batch, 8**-0.5, window)
        assert (out.device, out.shape, out.dtype) == (meta, (14, 32), torch.float32)


def test_a_step_of_one_prefill_chunk_is_attended_without_a_gather_or_a_scatter() -> None:
    # the group is exactly rows 0..T-1 in order (AttentionGroup: rows, src and dst None), as a batch of decode steps
    for spans in ([Span(0, 3, 9, [0, 1, 2])], [Span(i, 5, 1, [i, 3 + i]) for i in range(3)]):
        (group,) = build_attention_batch(
            spans, list(range(sum(s.num_tokens for s in spans))), 4, 2, native=False
        ).groups
        assert group.rows is None and group.src is None and group.dst is None
