"""The weights and KV pages on transparent huge pages (``native.memory``): copies equal to the originals, on
cache lines, the advice taken where the OS offers huge pages, and a model's tied LM head kept tied."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mechserve.kv.paged import PagedKVCache
from mechserve.native.memory import HUGE_PAGE, Arena, advised, huge_zeros


def test_an_arena_holds_exact_copies_on_cache_lines() -> None:
    parts = [torch.randn(3, 5), torch.randint(0, 255, (7, 33), dtype=torch.uint8), torch.randn(1000).bfloat16()]
    arena = Arena(parts)
    copies = [arena.place(t) for t in parts]
    for t, c in zip(parts, copies, strict=True):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous() and c.data_ptr() % 64 == 0
        assert c.data_ptr() != t.data_ptr()
    with pytest.raises(ValueError, match="the arena is full"):
        arena.place(parts[0])


def test_huge_zeros_are_zeros_of_the_shape_asked() -> None:
    for shape, dtype in (
        ((2, 3), torch.float32),
        ((3, HUGE_PAGE // 4 + 5), torch.float32),
        ((HUGE_PAGE,), torch.bfloat16),
    ):
        t = huge_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and not t.any()


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "never"


def test_the_advice_is_taken_where_the_os_offers_huge_pages() -> None:
    buf = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8)
    offered = sys.platform.startswith("linux") and _thp_mode() in ("madvise", "always")
    assert advised(buf) == offered
    assert not advised(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8))  # no whole huge page inside


def test_the_kv_pool_and_a_models_matrices_are_moved_and_a_tied_head_stays_tied(tmp_path: Path) -> None:
    from tiny_checkpoints import build_tiny

    cache = PagedKVCache(2, 300, 16, 2, 64)
    assert cache.k.shape == (2, 300, 16, 2, 64) and not cache.k.any() and not cache.v.any()
    for tie in (True, False):
        m = build_tiny(tmp_path / str(tie), tie_word_embeddings=tie).model  # its logits: test_llama_forward.py
        assert (m.lm_head is m.embed) == tie
        assert all(w.qkv.data_ptr() % 64 == 0 and w.down.data_ptr() % 64 == 0 for w in m.layers)
