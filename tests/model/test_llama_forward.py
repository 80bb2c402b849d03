"""Our paged, flat-batch forward against transformers' dense forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import Tiny, build_tiny, random_prompts

from mechserve.kv.paged import PagedKVCache, Span, build_attention_batch
from mechserve.model.llama import LlamaModel

TOL = 1e-4


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_chunks(
    model: LlamaModel, cache: PagedKVCache, chunks: list[tuple[list[int], int, list[int]]]
) -> list[torch.Tensor]:
    """One forward over several (ids, start, page_table) chunks; returns each chunk's logits [n, V]."""
    ps = cache.page_size
    spans, ids, pos, slots = [], [], [], []
    for chunk_ids, start, table in chunks:
        spans.append(Span(len(ids), start, len(chunk_ids), table))
        ids += chunk_ids
        for p in range(start, start + len(chunk_ids)):
            pos.append(p)
            slots.append(table[p // ps] * ps + p % ps)
    a = model.arch
    batch = build_attention_batch(spans, slots, ps, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows)
    logits = model.forward(torch.tensor(ids), torch.tensor(pos), cache, batch)
    out, row = [], 0
    for chunk_ids, _, _ in chunks:
        out.append(logits[row : row + len(chunk_ids)])
        row += len(chunk_ids)
    return out


def test_logits_match_transformers_on_scattered_pages(tiny: Tiny) -> None:
    (ids,) = random_prompts([23])
    cache = tiny.model.new_cache(num_pages=10, page_size=4)
    (ours,) = run_chunks(tiny.model, cache, [(ids, 0, [5, 2, 7, 0, 3, 9])])
    torch.testing.assert_close(ours, hf_logits(tiny.hf, ids), atol=TOL, rtol=0)


def test_mixed_batch_of_chunks_matches_transformers(tiny: Tiny) -> None:
    """Prefill chunks, a whole prompt and single-token rows in one step, reading earlier steps' pages."""
    a, b, c = random_prompts([19, 11, 7])
    cache = tiny.model.new_cache(num_pages=16, page_size=4)
    ta, tb, tc = [1, 2, 3, 4, 5], [15, 14, 13], [8, 9]
    step1 = run_chunks(tiny.model, cache, [(a[:8], 0, ta), (b, 0, tb), (c[:3], 0, tc)])
    step2 = run_chunks(tiny.model, cache, [(a[8:18], 8, ta), (c[3:], 3, tc)])
    step3 = run_chunks(tiny.model, cache, [(a[18:], 18, ta)])
    torch.testing.assert_close(torch.cat([step1[0], step2[0], step3[0]]), hf_logits(tiny.hf, a), atol=TOL, rtol=0)
    torch.testing.assert_close(step1[1], hf_logits(tiny.hf, b), atol=TOL, rtol=0)
    torch.testing.assert_close(torch.cat([step1[2], step2[1]]), hf_logits(tiny.hf, c), atol=TOL, rtol=0)


def test_logit_rows_select_rows(tiny: Tiny) -> None:
    (ids,) = random_prompts([9])
    cache = tiny.model.new_cache(num_pages=4, page_size=4)
    batch = build_attention_batch([Span(0, 0, 9, [0, 1, 2])], list(range(9)), 4, 2)
    rows = torch.tensor([8, 3])
    out = tiny.model.forward(torch.tensor(ids), torch.arange(9), cache, batch, rows)
    assert out.shape == (2, tiny.model.arch.vocab_size)
    torch.testing.assert_close(out, hf_logits(tiny.hf, ids)[rows], atol=TOL, rtol=0)


VARIANTS = {
    "tied-head": ("llama", dict(tie_word_embeddings=True)),
    "attention-bias": ("llama", dict(attention_bias=True)),
    "mlp-bias": ("llama", dict(mlp_bias=True)),
    "llama3-rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "qwen2": ("qwen2", dict()),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=16)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=5, head_dim=16)),
    "mha": ("llama", dict(num_key_value_heads=4)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_match_transformers(variant: str, tmp_path: Path) -> None:
    model_type, overrides = VARIANTS[variant]
    t = build_tiny(tmp_path, model_type, **overrides)
    a, b = random_prompts([21, 6], seed=3)
    cache = t.model.new_cache(num_pages=16, page_size=4)
    s1 = run_chunks(t.model, cache, [(a[:7], 0, [3, 4, 5, 6, 7, 8]), (b, 0, [1, 0])])
    s2 = run_chunks(t.model, cache, [(a[7:], 7, [3, 4, 5, 6, 7, 8])])
    torch.testing.assert_close(torch.cat([s1[0], s2[0]]), hf_logits(t.hf, a), atol=TOL, rtol=0)
    torch.testing.assert_close(s1[1], hf_logits(t.hf, b), atol=TOL, rtol=0)
