"""The native few-row linear kernel against torch's F.linear (dense) and the plain-torch block decoder
(quantized), and the paths ``linear`` chooses.

The kernel must build here (CI has a compiler): nothing in this file skips.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.api.errors import NativeKernelError
from mechserve.model import linear as lin
from mechserve.model.quantized import dequantize, quantize


@pytest.fixture(autouse=True)
def _fresh_mode():
    lin.enabled.cache_clear()
    yield
    lin.enabled.cache_clear()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 20),
    out_features=st.integers(1, 70),
    in_features=st.sampled_from([1, 5, 16, 31, 32, 33, 64, 100, 576]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    out_dtype=st.sampled_from([None, torch.float32]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dense_kernel_equals_f_linear(rows, out_features, in_features, dtype, out_dtype, with_bias, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    got = lin.native_linear(x, w, b, out_dtype)
    assert got.dtype == (out_dtype or dtype) and got.shape == (rows, out_features)
    # both accumulate in float32 in their own order; bf16 products are exact in float32
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if out_dtype == torch.float32 or dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["q4_1", "q8_0"]),
    rows=st.integers(1, 20),
    out_features=st.integers(1, 70),
    blocks=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_kernel_equals_the_dequantized_product(kind, rows, out_features, blocks, dtype, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    w = quantize(torch.randn(out_features, k, generator=g), kind)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    got = lin.native_linear(x, w, b, torch.float32)
    want = F.linear(x.float(), dequantize(w), None if b is None else b.float())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))
    # and the many-row path (blocks dequantized a slice at a time, then torch) gives the same
    many = lin._quantized_gemm(x.float(), w, None if b is None else b.float(), torch.float32)
    torch.testing.assert_close(many, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_rows_of_a_quantized_matrix_are_its_dequantized_rows() -> None:
    for kind in ("q4_1", "q8_0"):
        w = quantize(torch.randn(50, 96), kind)
        ids = torch.tensor([3, 0, 49, 3])
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(lin.dequantize_rows(w, ids, dtype), dequantize(w, dtype)[ids])


def test_few_rows_go_to_the_kernel_and_many_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = lin.native_linear

    def spy(x, w, b=None, out_dtype=None):
        calls.append(x.shape[0])
        return real(x, w, b, out_dtype)

    monkeypatch.setattr(lin, "native_linear", spy)
    w = torch.randn(8, 32)
    for rows in (1, 3, lin.NATIVE_MAX_ROWS, lin.NATIVE_MAX_ROWS + 1, 64):
        out = lin.linear(torch.randn(rows, 32), w)
        assert out.shape == (rows, 8)
    assert calls == [1, 3, lin.NATIVE_MAX_ROWS]
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    lin.enabled.cache_clear()
    lin.linear(torch.randn(1, 32), w)
    assert calls == [1, 3, lin.NATIVE_MAX_ROWS]  # torch mode: never the kernel


def test_torch_mode_multiplies_quantized_blocks_by_dequantizing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    w = quantize(torch.randn(40, 64), "q4_1")
    x = torch.randn(2, 64)
    with_kernel = lin.linear(x, w)
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    lin.enabled.cache_clear()
    torch.testing.assert_close(lin.linear(x, w), with_kernel, rtol=1e-5, atol=1e-5)


def test_bad_mode_and_native_without_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MECHSERVE_LINEAR", "gpu")
    with pytest.raises(ValueError, match="MECHSERVE_LINEAR must be one of auto, native, torch"):
        lin.enabled()
    monkeypatch.setenv("MECHSERVE_LINEAR", "native")
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    lin.library.cache_clear()
    try:
        with pytest.raises(NativeKernelError, match="no C\\+\\+ compiler found"):
            lin.enabled()
    finally:
        lin.library.cache_clear()


def test_rejects_what_it_cannot_handle() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        lin.native_linear(torch.zeros(1, 4, dtype=torch.float16), torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="differs from the activations"):
        lin.native_linear(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="features"):
        lin.native_linear(torch.zeros(1, 4), torch.zeros(2, 5))
