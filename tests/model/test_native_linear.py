"""The native linear kernel against torch's F.linear (dense) and the plain-torch block decoder (quantized),
at every row count (a format's few-row kernel and the register-blocked tiles), in this machine's build and
in every portable build it can run (``native_builds.ARCHS``: AVX-512 without BF16, AVX2 + FMA, the
baseline ISA), loaded side by side in one process, and the paths ``linear`` chooses.

The kernel must build here (CI has a compiler): nothing in this file skips.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from functools import cache
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from native_builds import ARCHS, ISA

from mechserve.api.errors import NativeKernelError
from mechserve.model import linear as lin
from mechserve.model.quantized import QuantizedMatrix, dequantize, quantize

# Row counts the products are checked at: every few-row count, every tile remainder (4x4 tiles), past 64
# (the largest decode batch) and past NATIVE_MAX_ROWS[bfloat16] (128), where the bfloat16 path hands over
# to torch.
ROWS = st.one_of(st.integers(1, 20), st.integers(21, 140))


@cache
def build(arch: str) -> ctypes.CDLL:
    """The kernel built for ``arch`` (this machine's build for ``native``)."""
    if arch == "native":
        return lin.library()
    return lin.bind(dataclasses.replace(lin.KERNEL, arch=arch).load())


@contextmanager
def using(arch: str):
    """The module's products run on the ``arch`` build inside the block."""
    lib = build(arch)
    with mock.patch.object(lin, "library", lambda: lib):
        yield lib


@pytest.fixture(autouse=True)
def _fresh_mode():
    lin.enabled.cache_clear()
    yield
    lin.enabled.cache_clear()


def test_the_builds_take_their_paths() -> None:
    assert lin.isa() in ("avx512+bf16", "avx512", "avx2", "portable")
    for arch in ARCHS[1:]:
        assert build(arch).mechserve_linear_isa() == ISA[arch]
    lib = lin.library()
    # formats.h's formats (numbers below 16); GGUF's others are csrc/kquants.cpp's (the issue 30 hook)
    own = sorted({t for t in lin.TYPES.values() if t < 16})
    assert own == [0, 1, 2, 3] and all(lib.mechserve_few_rows(t) >= 0 for t in own)
    assert all(lib.mechserve_few_rows(t) == -1 for t in lin.TYPES.values() if t >= 16)
    assert lib.mechserve_few_rows(99) == -1


def reference_weights(w: QuantizedMatrix, rows: int, dtype: torch.dtype, lib: ctypes.CDLL) -> torch.Tensor:
    """The float32 weights the kernel multiplies: the blocks' values exactly, except above a format's few
    rows with bfloat16 activations on a build with bfloat16 tiles, where they are rounded to bfloat16."""
    rounded = (
        dtype == torch.bfloat16 and rows > lib.mechserve_few_rows(lin.TYPES[w.kind]) and lib.mechserve_bf16_tiles()
    )
    return dequantize(w, torch.bfloat16).float() if rounded else dequantize(w)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))


@settings(max_examples=150, deadline=None)
@given(
    arch=st.sampled_from(ARCHS),
    rows=ROWS,
    out_features=st.integers(1, 70),
    in_features=st.sampled_from([1, 5, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 576, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    out_dtype=st.sampled_from([None, torch.float32]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dense_kernel_equals_f_linear(arch, rows, out_features, in_features, dtype, out_dtype, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    with using(arch):
        got = lin.native_linear(x, w, b, out_dtype)
    assert got.dtype == (out_dtype or dtype) and got.shape == (rows, out_features)
    # both accumulate in float32 in their own order; bf16 products are exact in float32
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    close(got, want, 1e-5 if out_dtype == torch.float32 or dtype == torch.float32 else 1e-2)


@settings(max_examples=150, deadline=None)
@given(
    arch=st.sampled_from(ARCHS),
    kind=st.sampled_from(["q4_1", "q8_0"]),
    rows=ROWS,
    out_features=st.integers(1, 70),
    blocks=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_kernel_equals_the_dequantized_product(
    arch, kind, rows, out_features, blocks, dtype, with_bias, seed
):
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    w = quantize(torch.randn(out_features, k, generator=g), kind)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    with using(arch) as lib:
        got = lin.native_linear(x, w, b, torch.float32)
        want = F.linear(x.float(), reference_weights(w, rows, dtype, lib), None if b is None else b.float())
        close(got, want, 1e-5)
        # and the many-row path (blocks dequantized a slice at a time, then torch) gives the float product
        many = lin._quantized_gemm(x.float(), w, None if b is None else b.float(), torch.float32)
    close(many, F.linear(x.float(), dequantize(w), None if b is None else b.float()), 1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, "q4_1", "q8_0"])
def test_long_rows_and_many_rows_pass_over_the_weights_in_blocks(arch: str, kind) -> None:
    """K large enough that the activation rows of one call are taken in several blocks (L2-sized), and rows
    that do not fill the last tile; N not a multiple of the tile width or of the threads' share."""
    g = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if kind != torch.float32 else torch.float32
    for rows, n, k in ((77, 37, 4096), (130, 19, 2048 + 32), (5, 1030, 1024)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        dense = torch.randn(n, k, generator=g) / k**0.5
        w = dense.to(kind) if isinstance(kind, torch.dtype) else quantize(dense, kind)
        with using(arch) as lib:
            got = lin.native_linear(x, w, None, torch.float32)
            ref = w.float() if isinstance(w, torch.Tensor) else reference_weights(w, rows, dtype, lib)
        close(got, F.linear(x.float(), ref), 1e-5)


def test_builds_loaded_side_by_side_keep_their_own_code() -> None:
    """Regression: the templates' static locals (tile tables, buffers) were GNU unique symbols, bound once per
    process, so a second build of the source loaded after the first ran with the first one's tables: the
    native build after the portable one wrote garbage columns (max error 34) or crashed, and the portable
    build after the native one ran the native code.  A fresh process loads them in both orders."""
    script = textwrap.dedent(
        """
        import dataclasses, sys, torch
        from mechserve.model import linear as lin
        from mechserve.model.quantized import dequantize, quantize
        libs = [(a, lin.bind(dataclasses.replace(lin.KERNEL, arch=a).load())) for a in sys.argv[1:]]
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(21, 96, generator=g), torch.randn(50, 96, generator=g)
        q = quantize(w, "q4_1")
        for arch, lib in libs:
            lin.library = lambda lib=lib: lib
            assert lib.mechserve_linear_isa() == {isa!r}.get(arch, lib.mechserve_linear_isa()), arch
            torch.testing.assert_close(lin.native_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(lin.native_linear(x, q), x @ dequantize(q).T, rtol=1e-5, atol=1e-4)
        print("ok")
        """
    ).format(isa=ISA)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(lin.KERNEL.source.parents[3]), os.environ.get("PYTHONPATH", "")]),
    }
    for order in (ARCHS, ARCHS[::-1]):
        done = subprocess.run(
            [sys.executable, "-c", script, *order], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is an x86-64 instruction set")
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(2, 40),
    out_features=st.integers(1, 70),
    in_features=st.sampled_from([5, 8, 17, 64, 100, 576]),
    seed=st.integers(0, 2**16),
)
# every row count that takes 6 x 2 tiles up to 20 (gemm.h, tall_tiles), and ones beside them that take 4 x 3
@example(rows=5, out_features=70, in_features=576, seed=1)
@example(rows=6, out_features=33, in_features=100, seed=2)
@example(rows=9, out_features=70, in_features=17, seed=3)
@example(rows=10, out_features=64, in_features=576, seed=4)
@example(rows=17, out_features=7, in_features=64, seed=5)
@example(rows=18, out_features=70, in_features=576, seed=6)
@example(rows=11, out_features=70, in_features=576, seed=7)
@example(rows=4, out_features=70, in_features=576, seed=8)
def test_avx2_bfloat16_rows_do_not_depend_on_the_rows_beside_them(rows, out_features, in_features, seed):
    """The AVX2 build multiplies bfloat16 weights in tiles from 2 rows on (its few-row count is 1; 4 x 3
    tiles, or 6 x 2 where a short last tile would widen the weights again) and sums each output in one order,
    so a row of a speculative window gets, bit for bit, what it gets beside any other rows: a window's
    products do not depend on how many guesses it carries, nor on the tiles' shape."""
    dtype = torch.bfloat16
    arch = "native" if lin.isa() == "avx2" else "x86-64-v3"
    assert arch in ARCHS, "this x86-64 CPU has no AVX2 build to check"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    with using(arch) as lib:
        assert lib.mechserve_few_rows(lin.TYPES[dtype]) == 1
        together = lin.native_linear(x, w, None, torch.float32)
        # each row beside the next one (the last beside the first), in a product of two rows
        pairs = [lin.native_linear(x[[i, (i + 1) % rows]], w, None, torch.float32)[0] for i in range(rows)]
        assert torch.equal(together, torch.stack(pairs))
        # one row alone is the few-row loop's: the same products, summed in another order
        close(lin.native_linear(x[:1], w, None, torch.float32), together[:1].float(), 1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_any_thread_count_gives_the_same_product(threads: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 96, generator=g)
    w = torch.randn(50, 96, generator=g)
    for arch in ARCHS:
        with using(arch):
            before = torch.get_num_threads()
            try:
                torch.set_num_threads(threads)
                got = lin.native_linear(x, w)
                q = lin.native_linear(x.bfloat16(), quantize(w, "q4_1"), None, torch.float32)
                b = lin.native_linear(x.bfloat16(), w.bfloat16(), None, torch.float32)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(got, lin.native_linear(x, w))  # each output is one thread's sum, in one order
            assert torch.equal(b, lin.native_linear(x.bfloat16(), w.bfloat16(), None, torch.float32))
            assert torch.equal(q, lin.native_linear(x.bfloat16(), quantize(w, "q4_1"), None, torch.float32))
            close(got, x @ w.T, 1e-5)


def test_rows_of_a_quantized_matrix_are_its_dequantized_rows() -> None:
    for arch in ARCHS:
        for kind in ("q4_1", "q8_0"):
            w = quantize(torch.randn(50, 96), kind)
            ids = torch.tensor([3, 0, 49, 3])
            for dtype in (torch.float32, torch.bfloat16):
                with using(arch):
                    assert torch.equal(lin.dequantize_rows(w, ids, dtype), dequantize(w, dtype)[ids])


def test_each_kind_goes_to_the_kernel_up_to_its_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    real = lin.native_linear

    def spy(x, w, b=None, out_dtype=None):
        calls.append((str(w.kind if isinstance(w, QuantizedMatrix) else w.dtype), x.shape[0]))
        return real(x, w, b, out_dtype)

    monkeypatch.setattr(lin, "native_linear", spy)
    weights = {
        torch.float32: torch.randn(8, 32),
        torch.bfloat16: torch.randn(8, 32).bfloat16(),
        "q4_1": quantize(torch.randn(8, 32), "q4_1"),
    }
    want = []
    for kind, w in weights.items():
        limit = lin.NATIVE_MAX_ROWS[kind]
        dtype = torch.float32 if kind == torch.float32 else torch.bfloat16
        for rows in (1, 3, 64, min(limit, 300), min(limit + 1, 301)):
            out = lin.linear(torch.randn(rows, 32).to(dtype), w)
            assert out.shape == (rows, 8)
            if rows <= limit:
                want.append((str(kind), rows))
    assert calls == want
    assert ("torch.float32", 301) in want  # float32 weights: the kernel at any row count
    assert ("torch.bfloat16", 129) not in want and ("q4_1", 257) not in want  # then oneDNN
    calls.clear()
    monkeypatch.setenv("MECHSERVE_LINEAR", "torch")
    lin.enabled.cache_clear()
    lin.linear(torch.randn(1, 32), weights[torch.float32])
    assert calls == []  # torch mode: never the kernel


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
