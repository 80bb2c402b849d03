"""GGUF's other weight formats (model/kquants.py, csrc/kquants.cpp): the kernel against gguf-py's reference
decoder over random blocks, the encoders against that decoder, and every path a product of them takes.

The kernel must build here (CI has a compiler): nothing in this file skips.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mechserve.model.llama as llama
from mechserve.model import fused, kquants
from mechserve.model import linear as lin
from mechserve.model.kquants import FORMATS, NATIVE_KINDS, dequantize_blocks, quantize_blocks, row_bytes
from mechserve.model.llama import LayerWeights
from mechserve.model.quantized import QuantizedMatrix, dequantize, quantize

# Where each format keeps its fp16 scales in a block (byte offsets): random bytes there could be NaN or
# inf, which no encoder writes, so those are set to random finite halves.
HALVES = {"q4_0": (0,), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
BLOCK_KINDS = ("f16", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


@pytest.fixture(autouse=True)
def _fresh_mode():
    lin.enabled.cache_clear()
    lin.external_formats.cache_clear()
    kquants.enabled.cache_clear()
    yield
    lin.enabled.cache_clear()
    lin.external_formats.cache_clear()
    kquants.enabled.cache_clear()


def random_blocks(kind: str, rows: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks of ``kind``: every bit random but the fp16 scales, which are
    random finite values of either sign (Q6_K's int8 sub-scales and K-quants' six-bit ones random too)."""
    nbytes = row_bytes(kind, in_features)
    raw = torch.randint(0, 256, (rows, nbytes), generator=g, dtype=torch.uint8)
    f = FORMATS[kind]
    if kind == "f16":
        return (torch.randn(rows, in_features, generator=g) * 0.5).half().view(torch.uint8).reshape(rows, -1)
    blocks = raw.view(rows, in_features // f.block, f.block_bytes)
    for at in HALVES[kind]:
        halves = (torch.randn(rows, in_features // f.block, generator=g) * 0.01).half()
        blocks[..., at : at + 2] = halves.view(torch.uint8).view(rows, -1, 2)
    return raw


def test_the_formats_table_is_ggmls() -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for f in FORMATS.values():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(f.ggml_type)] == (f.block, f.block_bytes), f.kind
    assert set(NATIVE_KINDS) == {*BLOCK_KINDS, "mixed"}


@settings(max_examples=50, deadline=None)
@given(
    kind=st.sampled_from(BLOCK_KINDS),
    rows=st.integers(1, 40),
    blocks=st.integers(1, 3),
    m=st.integers(1, lin.NATIVE_MAX_ROWS[NATIVE_KINDS[0]]),
    out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_multiplies_random_blocks_as_the_reference_decodes_them(kind, rows, blocks, m, out_dtype, seed):
    """Random blocks, not our encoder's: the kernel's rows are the reference's bit for bit, its products
    (reference rows) . x up to float32 summation order."""
    g = torch.Generator().manual_seed(seed)
    k = max(FORMATS[kind].block, 32) * blocks * (8 if FORMATS[kind].block == 1 else 1)
    b = random_blocks(kind, rows, k, g)
    ref = dequantize_blocks(kind, b, k)  # gguf-py's decoder
    assert torch.isfinite(ref).all()
    ids = torch.randint(0, rows, (7,), generator=g)
    assert torch.equal(kquants.dequantize_rows(kind, b, k, ids, torch.float32), ref[ids])
    assert torch.equal(kquants.dequantize_rows(kind, b, k, ids, torch.bfloat16), ref[ids].bfloat16())
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(rows, generator=g)
    got = kquants.native_linear(x, kind, b, rows, bias, out_dtype)
    want = (x.double() @ ref.double().T + bias.double()).float()
    scale = (x.double().abs() @ ref.double().abs().T).max().item() + 1.0
    assert got.dtype == out_dtype
    torch.testing.assert_close(
        got.float(),
        want.to(out_dtype).float(),
        rtol=8e-3 if out_dtype == torch.bfloat16 else 0,
        atol=1e-6 * scale + (0 if out_dtype == torch.float32 else 1e-2 * scale),
    )


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(BLOCK_KINDS), rows=st.integers(1, 9), blocks=st.integers(1, 3), seed=st.integers(0, 99))
def test_encode_then_decode_is_within_the_formats_step(kind, rows, blocks, seed) -> None:
    """Our encoders (gguf-py's for Q4_0/Q5_0/Q5_1) against gguf-py's decoder: every weight within half a
    step of its sub-block's scale plus the rounding of the stored scales; re-encoding the decoded values
    moves none by more than that again."""
    g = torch.Generator().manual_seed(seed)
    k = FORMATS[kind].block * blocks if FORMATS[kind].block > 1 else 64 * blocks
    w = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g)
    b = quantize_blocks(w, kind)
    assert b.shape == (rows, row_bytes(kind, k)) and b.dtype == torch.uint8
    back = dequantize_blocks(kind, b, k)
    group = {"f16": 1, "q4_0": 32, "q5_0": 32, "q5_1": 32, "q4_k": 32, "q5_k": 32, "q6_k": 16}[kind]
    levels = {"f16": 2048, "q4_0": 15, "q5_0": 31, "q5_1": 31, "q4_k": 15, "q5_k": 31, "q6_k": 63}[kind]
    wg, bg = w.view(rows, -1, group), back.view(rows, -1, group)
    span = (wg.amax(-1, keepdim=True) - wg.amin(-1, keepdim=True).clamp(max=0)).clamp(
        min=wg.abs().amax(-1, keepdim=True)
    )
    big = w.abs().amax(-1, keepdim=True).view(rows, 1, 1)
    # half a step of the group, the six/eight-bit rounding of its scale against the block's fp16 one
    bound = span / levels * 0.5 + span * 0.04 + big * 4e-3 + 1e-6
    assert bool(((bg - wg).abs() <= bound).all()), float(((bg - wg).abs() - bound).max())
    again = dequantize_blocks(kind, quantize_blocks(back, kind), k)
    assert bool(((again.view_as(bg) - bg).abs() <= bound).all())


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_zero_rows_stay_zero_and_a_bad_width_is_refused(kind) -> None:
    k = 256
    assert torch.equal(dequantize_blocks(kind, quantize_blocks(torch.zeros(3, k), kind), k), torch.zeros(3, k))
    if FORMATS[kind].block > 1:
        with pytest.raises(ValueError, match=f"multiple of {FORMATS[kind].block}"):
            quantize_blocks(torch.zeros(2, FORMATS[kind].block + 16), kind)
        with pytest.raises(ValueError, match="do not hold"):
            QuantizedMatrix(kind, torch.zeros(2, 3, dtype=torch.uint8), FORMATS[kind].block)
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize_blocks(torch.zeros(2, 256), "q2_k")


def test_k_quant_encoders_keep_ggmls_layout() -> None:
    """Rows a K-quant holds exactly decode to themselves: sub-block scales that are whole multiples (up
    to 63) of the block's fp16 ``d`` times each level 0..15 (Q4_K) or 0..31 (Q5_K), and for Q6_K groups
    of levels -32..31 of one scale; so the packing of scales, mins, nibbles and high bits is ggml's."""
    steps = torch.tensor([63.0, 1, 5, 10, 20, 30, 40, 50]) * 0.125  # d = 0.125, six-bit scales 63, 1, 5, ...
    for kind, levels in (("q4_k", 16), ("q5_k", 32)):
        q = (torch.arange(256) * 7 % levels).float().view(8, 32)
        row = (q * steps[:, None]).reshape(1, 256)
        assert torch.equal(dequantize_blocks(kind, quantize_blocks(row, kind), 256), row), kind
    q6 = (torch.arange(256) * 5 % 64 - 32).float().view(16, 16)
    q6[:, 0] = -32  # each group's largest magnitude, so every group has the same scale
    six = (q6 * 0.25).reshape(1, 256)
    assert torch.equal(dequantize_blocks("q6_k", quantize_blocks(six, "q6_k"), 256), six)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from([*BLOCK_KINDS, "f32", "bf16"]),
    rows=st.sampled_from([1, 2, 3, 7, 16, 17, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    mode=st.sampled_from(["auto", "torch"]),
    seed=st.integers(0, 2**16),
)
def test_linear_takes_every_format_at_any_row_count(kind, rows, dtype, mode, seed) -> None:
    """``linear`` with a matrix of any GGUF format: the kernel for few rows, dequantized slices and torch's
    GEMM for many, the reference decoder under MECHSERVE_LINEAR=torch; all equal the dequantized product."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MECHSERVE_LINEAR", mode)
        lin.enabled.cache_clear()
        kquants.enabled.cache_clear()
        _linear_case(kind, rows, dtype, seed)
    lin.enabled.cache_clear()
    kquants.enabled.cache_clear()


def _linear_case(kind: str, rows: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 512, generator=g) / 512**0.5
    q = quantize(w, kind)
    ref = dequantize(q)
    x = torch.randn(rows, 512, generator=g).to(dtype)
    got = lin.linear(x, q)
    want = F.linear(x.float(), ref)
    assert got.dtype == dtype and got.shape == (rows, 48)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    ids = torch.tensor([3, 0, 47])
    assert torch.equal(lin.dequantize_rows(q, ids, torch.float32), ref[ids])


H, HEADS, KV, D, MLP = 256, 4, 2, 64, 512


def kquant_layer(g: torch.Generator, dtype: torch.dtype, kinds: tuple[str, ...]) -> LayerWeights:
    """A layer whose q, k, v are ``kinds[0:3]`` (fused: a mixed matrix when they differ), o, gate/up and down
    ``kinds[3:6]``."""

    def matrix(n: int, k: int, kind: str):
        return quantize(torch.randn(n, k, generator=g) / k**0.5, kind)

    q, k, v = (matrix(rows, H, kind) for rows, kind in zip((HEADS * D, KV * D, KV * D), kinds[:3], strict=True))
    kinds = kinds[2:]
    return LayerWeights(
        input_norm=(1 + 0.2 * torch.randn(H, generator=g)).to(dtype),
        qkv=QuantizedMatrix.cat([q, k, v]),
        qkv_bias=None,
        o=matrix(H, HEADS * D, kinds[1]),
        o_bias=None,
        q_norm=None,
        k_norm=None,
        post_norm=(1 + 0.2 * torch.randn(H, generator=g)).to(dtype),
        gate_up=matrix(2 * MLP, H, kinds[2]),
        gate_up_bias=None,
        down=matrix(H, MLP, kinds[3]),
        down_bias=None,
    )


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, lin.NATIVE_MAX_ROWS[NATIVE_KINDS[0]]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kinds=st.tuples(*(st.sampled_from([*BLOCK_KINDS, "q4_1", "q8_0"]) for _ in range(6))),
    seed=st.integers(0, 2**16),
)
def test_the_fused_blocks_take_mixed_formats(rows, dtype, kinds, seed) -> None:
    """A layer mixing formats (as Q4_K_M files do) runs natively, through linear.cpp's registered hook,
    and computes what torch's blocks compute from the same matrices."""
    g = torch.Generator().manual_seed(seed)
    w = kquant_layer(g, dtype, kinds)
    x = torch.randn(rows, H, generator=g).to(dtype)
    attn = torch.randn(rows, HEADS * D, generator=g).to(dtype)
    freqs = torch.arange(rows).float()[:, None] * (10000.0 ** (-torch.arange(0, D, 2).float() / D))[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    assert fused.weights_apply(w, dtype) and fused.rows_apply(x, w)
    got = (*fused.attention_inputs(x, w, cos, sin, 1e-5, HEADS, KV, D), fused.attention_outputs(x, attn, w, 1e-5))
    plain = dataclasses.replace(
        w, qkv=dequantize(w.qkv), o=dequantize(w.o), gate_up=dequantize(w.gate_up), down=dequantize(w.down)
    )
    monkey = (
        plain
        if dtype == torch.float32
        else dataclasses.replace(
            plain,
            qkv=plain.qkv.to(dtype),
            o=plain.o.to(dtype),
            gate_up=plain.gate_up.to(dtype),
            down=plain.down.to(dtype),
        )
    )
    want = (
        *llama.attention_inputs(x, w.input_norm, monkey.qkv, None, None, None, cos, sin, 1e-5, HEADS, KV, D),
        llama.attention_outputs(x, attn, monkey.o, None, w.post_norm, monkey.gate_up, None, monkey.down, None, 1e-5),
    )
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_without_the_k_quant_kernel_the_layer_stays_in_torch(monkeypatch) -> None:
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    w = kquant_layer(torch.Generator().manual_seed(0), torch.float32, ("q4_k", "q4_k", "q6_k", "q5_0", "q6_k", "f16"))
    assert not fused.weights_apply(w, torch.float32)
    x = torch.randn(2, 512)
    torch.testing.assert_close(lin.linear(x, w.down), x @ dequantize(w.down).T, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    kinds=st.lists(st.sampled_from([*BLOCK_KINDS, "q4_1", "q8_0", "f32", "bf16"]), min_size=2, max_size=4),
    m=st.sampled_from([1, 3, 16, 40]),
    seed=st.integers(0, 2**16),
)
def test_a_mixed_matrix_is_each_part_as_stored(kinds, m, seed) -> None:
    """Parts of different formats stacked (``QuantizedMatrix.cat``): the kernel's rows and products are the
    parts' reference decoders', in every path ``linear`` takes."""
    g = torch.Generator().manual_seed(seed)
    parts = [quantize(torch.randn(int(torch.randint(1, 40, (1,), generator=g)), 512, generator=g), k) for k in kinds]
    mixed = QuantizedMatrix.cat(parts)
    ref = torch.cat([dequantize(p) for p in parts])
    assert mixed.shape == ref.shape and torch.equal(dequantize(mixed), ref)
    ids = torch.randint(0, ref.shape[0], (9,), generator=g)
    assert torch.equal(lin.dequantize_rows(mixed, ids, torch.float32), ref[ids])
    x = torch.randn(m, 512, generator=g)
    torch.testing.assert_close(lin.linear(x, mixed), x @ ref.T, rtol=1e-4, atol=1e-4)
    assert (mixed.kind == "mixed") == (len(set(kinds)) > 1)  # one format stacks plainly
    if mixed.segments:
        again = QuantizedMatrix.cat([mixed, parts[0]])  # a mixed part flattens into its pieces
        assert again.segments == (*mixed.segments, (parts[0].kind, parts[0].shape[0]))


def test_the_reference_decoder_is_gguf_pys() -> None:
    """``dequantize_blocks`` is gguf.quants.dequantize, byte for byte, for every kind (f32/bf16 by view)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    g = torch.Generator().manual_seed(1)
    for kind in BLOCK_KINDS:
        b = random_blocks(kind, 3, 256, g)
        want = gguf_dequantize(b.numpy(), GGMLQuantizationType(FORMATS[kind].ggml_type))
        assert np.array_equal(dequantize_blocks(kind, b, 256).numpy(), want.reshape(3, 256)), kind
