"""The native decoder-layer blocks (model/fused.py) against llama.py's torch blocks, and when the forward uses them.

The kernel must build here (CI has a compiler): nothing in this file skips.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mechserve.model.llama as llama
from mechserve.model import fused
from mechserve.model import linear as lin
from mechserve.model.llama import LayerWeights
from mechserve.model.quantized import quantize

H, HEADS, KV, D, MLP = 64, 4, 2, 16, 96  # hidden, query heads, KV heads, head dim, MLP width


@pytest.fixture(autouse=True)
def _fresh_mode():
    lin.enabled.cache_clear()
    yield
    lin.enabled.cache_clear()


def layer(g: torch.Generator, dtype: torch.dtype, kind: str | None, biases: bool) -> LayerWeights:
    def matrix(n: int, k: int):
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        return w if kind is None else quantize(w.float(), kind)

    def vector(n: int, scale: float = 1.0) -> torch.Tensor:
        return (1.0 + scale * torch.randn(n, generator=g)).to(dtype)

    def bias(n: int) -> torch.Tensor | None:
        return (0.1 * torch.randn(n, generator=g)).to(dtype) if biases else None

    return LayerWeights(
        input_norm=vector(H, 0.2),
        qkv=matrix((HEADS + 2 * KV) * D, H),
        qkv_bias=bias((HEADS + 2 * KV) * D),
        o=matrix(H, HEADS * D),
        o_bias=bias(H),
        q_norm=None,
        k_norm=None,
        post_norm=vector(H, 0.2),
        gate_up=matrix(2 * MLP, H),
        gate_up_bias=bias(2 * MLP),
        down=matrix(H, MLP),
        down_bias=bias(H),
    )


def rope(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(100, 100 + rows).float()[:, None] * (10000.0 ** (-torch.arange(0, D, 2).float() / D))[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, lin.NATIVE_MAX_ROWS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.sampled_from([None, "q4_1", "q8_0"]),
    biases=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_blocks_compute_what_the_torch_blocks_compute(rows, dtype, kind, biases, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    w = layer(g, dtype, kind, biases)
    x = torch.randn(rows, H, generator=g).to(dtype)
    attn = torch.randn(rows, HEADS * D, generator=g).to(dtype)
    cos, sin = rope(rows, dtype)
    assert fused.weights_apply(w, dtype) and fused.rows_apply(x)
    want = llama.attention_inputs(x, w.input_norm, w.qkv, w.qkv_bias, None, None, cos, sin, 1e-5, HEADS, KV, D)
    got = fused.attention_inputs(x, w, cos, sin, 1e-5, HEADS, KV, D)
    want_x = llama.attention_outputs(
        x, attn, w.o, w.o_bias, w.post_norm, w.gate_up, w.gate_up_bias, w.down, w.down_bias, 1e-5
    )
    got_x = fused.attention_outputs(x, attn, w, 1e-5)
    # float32: only the order of the RMSNorm and product sums differs.  bfloat16: the same roundings
    # as torch's ops, so a value moves by at most one bfloat16 step where a sum's order tips it.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    got, want = (*got, got_x), (*want, want_x)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)
    if dtype == torch.bfloat16:  # almost every value is bit-identical
        same = sum(int((a == b).sum()) for a, b in zip(got, want, strict=True))
        total = sum(a.numel() for a in got)
        assert same >= 0.97 * total


def test_which_layers_and_rows_run_natively() -> None:
    g = torch.Generator().manual_seed(0)
    w = layer(g, torch.float32, None, biases=True)
    assert fused.weights_apply(w, torch.float32)
    assert not fused.weights_apply(w, torch.bfloat16)  # weights in another dtype than the activations
    qwen3 = dataclasses.replace(w, q_norm=torch.ones(D), k_norm=torch.ones(D))
    assert not fused.weights_apply(qwen3, torch.float32)  # per-head q/k norms stay in torch
    assert fused.rows_apply(torch.zeros(lin.NATIVE_MAX_ROWS, H))
    assert not fused.rows_apply(torch.zeros(lin.NATIVE_MAX_ROWS + 1, H))  # prefill: torch's GEMM
    assert not fused.rows_apply(torch.zeros(1, H, dtype=torch.float16))


def test_forward_uses_the_native_blocks_for_few_rows_only(monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    """The forward of a decode step goes through the native blocks, a prefill chunk through torch's, and
    ``MECHSERVE_LINEAR=torch`` keeps every step in torch; the logits agree either way."""
    from mechserve.kv.paged import Span, build_attention_batch
    from mechserve.model.loader import load_model

    m = load_model(str(tiny.path), dtype=torch.float32, tokenizer=False).model
    assert m.native_layers
    calls: list[int] = []
    real = fused.attention_inputs

    def counted(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(fused, "attention_inputs", counted)

    def run(ctx: int) -> torch.Tensor:
        page = 16
        cache = m.new_cache(-(-(ctx + 1) // page), page)
        table = list(range(cache.num_pages))
        ids = torch.arange(3, 3 + ctx + 1) % m.arch.vocab_size
        g = m.arch.num_heads // m.arch.num_kv_heads
        b = build_attention_batch([Span(0, 0, ctx, table)], list(range(ctx)), page, g, m.distinct_sliding_windows)
        m.forward(ids[:ctx], torch.arange(ctx), cache, b, None)  # the prefill
        b = build_attention_batch([Span(0, ctx, 1, table)], [ctx], page, g, m.distinct_sliding_windows)
        return m.forward(ids[ctx:], torch.tensor([ctx]), cache, b, None)  # one decode step

    native = run(40)
    assert calls == [1] * m.arch.num_layers  # the 40-row prefill ran in torch, the step natively
    calls.clear()
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    lin.enabled.cache_clear()
    torch_only = run(40)
    assert calls == []
    torch.testing.assert_close(native, torch_only, rtol=1e-4, atol=1e-4)
