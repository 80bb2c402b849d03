"""The native decoder-layer blocks (model/fused.py) against llama.py's torch blocks, at every row count and in
the portable builds, and when the forward uses them.

The kernel must build here (CI has a compiler): nothing in this file skips.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mechserve.model.llama as llama
from mechserve.model import fused
from mechserve.model import linear as lin
from mechserve.model.llama import LayerWeights
from mechserve.model.quantized import quantize

from .test_native_linear import ARCHS, ROWS, build

H, HEADS, KV, D, MLP = 64, 4, 2, 16, 96  # hidden, query heads, KV heads, head dim, MLP width
# (hidden, query heads, KV heads, head dim, MLP width): SmolLM2's proportions small, one with odd widths
# (dense weights only: a block format needs widths that are multiples of 32)
SHAPES = [(H, HEADS, KV, D, MLP), (96, 3, 1, 32, 160), (40, 5, 5, 8, 24)]


@pytest.fixture(autouse=True)
def _fresh_mode():
    lin.enabled.cache_clear()
    yield
    lin.enabled.cache_clear()


def layer(
    g: torch.Generator, dtype: torch.dtype, kind: str | tuple | None, biases: bool, shape=SHAPES[0]
) -> LayerWeights:
    """A random layer; ``kind``: every matrix's format (None: ``dtype``), or one per matrix (qkv, o, gate_up,
    down), as a GGUF file may mix them."""
    hidden, heads, kv, d, mlp = shape
    kinds = iter(kind if isinstance(kind, tuple) else (kind,) * 4)

    def matrix(n: int, k: int):
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        this = next(kinds)
        return w if this is None else quantize(w.float(), this)

    def vector(n: int, scale: float = 1.0) -> torch.Tensor:
        return (1.0 + scale * torch.randn(n, generator=g)).to(dtype)

    def bias(n: int) -> torch.Tensor | None:
        return (0.1 * torch.randn(n, generator=g)).to(dtype) if biases else None

    return LayerWeights(
        input_norm=vector(hidden, 0.2),
        qkv=matrix((heads + 2 * kv) * d, hidden),
        qkv_bias=bias((heads + 2 * kv) * d),
        o=matrix(hidden, heads * d),
        o_bias=bias(hidden),
        q_norm=None,
        k_norm=None,
        post_norm=vector(hidden, 0.2),
        gate_up=matrix(2 * mlp, hidden),
        gate_up_bias=bias(2 * mlp),
        down=matrix(hidden, mlp),
        down_bias=bias(hidden),
    )


def rope(rows: int, dtype: torch.dtype, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(100, 100 + rows).float()[:, None] * (10000.0 ** (-torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


KINDS = [None, "q4_1", "q8_0"]


@settings(max_examples=100, deadline=None)
@given(
    arch=st.sampled_from(ARCHS),
    rows=ROWS,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.one_of(st.sampled_from(KINDS), st.tuples(*[st.sampled_from(KINDS)] * 4)),
    shape=st.sampled_from(SHAPES),
    biases=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_blocks_compute_what_the_torch_blocks_compute(arch, rows, dtype, kind, shape, biases, seed) -> None:
    hidden, heads, kv, d, mlp = shape
    if (hidden % 32 or heads * d % 32 or mlp % 32) and kind is not None:
        kind = None  # a block format needs rows that are a multiple of 32 wide
    kinds = [k for k in (kind if isinstance(kind, tuple) else (kind,)) if k is not None]
    g = torch.Generator().manual_seed(seed)
    w = layer(g, dtype, kind, biases, shape)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    attn = torch.randn(rows, heads * d, generator=g).to(dtype)
    cos, sin = rope(rows, dtype, d)
    assert fused.weights_apply(w, dtype)  # (the blocks take any row count; rows_apply says where they pay)
    lib = build(arch)
    # The reference: torch's blocks with torch's products, except where the kernel keeps a block format's
    # weights exact with bfloat16 activations (few rows, or a build without bfloat16 tiles), which no torch
    # product does: there the kernel's own products (tested against torch in test_native_linear.py), so the
    # blocks' other steps are what is compared.
    few = any(rows <= lib.mechserve_few_rows(lin.TYPES[k]) for k in kinds)
    exact_blocks = bool(kinds) and dtype == torch.bfloat16 and (few or not lib.mechserve_bf16_tiles())
    with mock.patch.object(lin, "enabled", lambda: exact_blocks), mock.patch.object(lin, "library", lambda: lib):
        want = llama.attention_inputs(x, w.input_norm, w.qkv, w.qkv_bias, None, None, cos, sin, 1e-5, heads, kv, d)
        want_x = llama.attention_outputs(
            x, attn, w.o, w.o_bias, w.post_norm, w.gate_up, w.gate_up_bias, w.down, w.down_bias, 1e-5
        )
    with mock.patch.object(fused, "library", lambda: lib):
        got = fused.attention_inputs(x, w, cos, sin, 1e-5, heads, kv, d)
        got_x = fused.attention_outputs(x, attn, w, 1e-5)
    # float32: only the order of the RMSNorm and product sums differs (and exp's last bit).  bfloat16: the
    # same roundings as torch's ops, so a value moves by at most one bfloat16 step where a sum's order tips
    # it; a block format's weights are rounded to bfloat16 on both sides above its few rows.
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
    assert fused.rows_apply(torch.zeros(600, H), w)  # float32: the kernel at any row count
    b = layer(g, torch.bfloat16, None, biases=False)
    most = lin.NATIVE_MAX_ROWS[torch.bfloat16]
    assert fused.rows_apply(torch.zeros(most, H, dtype=torch.bfloat16), b)
    assert not fused.rows_apply(torch.zeros(most + 1, H, dtype=torch.bfloat16), b)  # prefill: oneDNN's GEMM
    q = layer(g, torch.bfloat16, "q8_0", biases=False)
    assert fused.rows_apply(torch.zeros(lin.NATIVE_MAX_ROWS["q8_0"], H, dtype=torch.bfloat16), q)
    assert not fused.rows_apply(torch.zeros(lin.NATIVE_MAX_ROWS["q8_0"] + 1, H, dtype=torch.bfloat16), q)
    assert not fused.rows_apply(torch.zeros(1, H, dtype=torch.float16), w)


def test_forward_uses_the_native_blocks_where_the_kernel_takes_the_rows(monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    """In float32 a prefill chunk and a decode step both go through the native blocks, and
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
    assert calls == [40] * m.arch.num_layers + [1] * m.arch.num_layers  # the prefill and the step natively
    calls.clear()
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    lin.enabled.cache_clear()
    torch_only = run(40)
    assert calls == []
    torch.testing.assert_close(native, torch_only, rtol=1e-4, atol=1e-4)
