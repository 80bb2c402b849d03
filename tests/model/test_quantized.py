"""GGUF blocks: the quantizers (ggml's rounding), the embedded file read as it is, and quantized models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.api.config import EngineConfig
from mechserve.model.loader import load_model
from mechserve.model.quantized import QuantizedMatrix, dequantize, quantize


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["q4_1", "q8_0"]), rows=st.integers(1, 9), blocks=st.integers(1, 6), seed=st.integers(0, 99)
)
def test_quantize_then_dequantize_is_within_half_a_step(kind, rows, blocks, seed) -> None:
    w = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    q = quantize(w, kind)
    assert q.shape == tuple(w.shape) and q.nbytes == rows * blocks * {"q4_1": 20, "q8_0": 34}[kind]
    back = dequantize(q)
    groups = w.view(rows, blocks, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15 if kind == "q4_1" else groups.abs().amax(-1) / 127
    # half a step of rounding, plus fp16 rounding of the block's scale (and minimum)
    bound = step[..., None] * 0.5 + groups.abs().amax(-1, keepdim=True) * 2e-3 + 1e-6
    assert bool(((back.view(rows, blocks, 32) - groups).abs() <= bound).all())
    # quantizing the dequantized values again gives the same blocks (a fixed point, as re-quantizing a file)
    assert torch.equal(quantize(back, kind).blocks, q.blocks)


def test_exact_values_round_trip_and_zero_blocks_stay_zero() -> None:
    w = torch.zeros(2, 64)
    w[0, :32] = torch.arange(-16, 16).float() * 0.5  # q8_0: d = 8 / 127; values are multiples of 0.5 only loosely
    for kind in ("q4_1", "q8_0"):
        q = quantize(w, kind)
        assert torch.equal(dequantize(q)[1], torch.zeros(64))
    levels = torch.arange(32).float().remainder(16).view(1, 32)  # 0..15 twice: exact in Q4_1 (d = 1, m = 0)
    assert torch.equal(dequantize(quantize(levels, "q4_1")), levels)


def test_a_matrix_refuses_shapes_its_format_cannot_hold() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(2, 40), "q4_1")
    with pytest.raises(ValueError, match="unknown block format"):
        quantize(torch.zeros(2, 32), "q2_k")
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedMatrix("q8_0", torch.zeros(2, 20, dtype=torch.uint8), 32)
    a, b = quantize(torch.zeros(1, 32), "q4_1"), quantize(torch.zeros(1, 64), "q8_0")
    with pytest.raises(ValueError, match="different widths"):
        QuantizedMatrix.cat([a, b])
    # different formats of one width stack into a mixed matrix (a GGUF file's q, k, v), each part as stored
    w = torch.randn(3, 32)
    mixed = QuantizedMatrix.cat([quantize(w[:1], "q4_1"), quantize(w[1:], "q8_0")])
    assert mixed.kind == "mixed" and mixed.shape == (3, 32) and mixed.segments == (("q4_1", 1), ("q8_0", 2))
    assert torch.equal(
        dequantize(mixed), torch.cat([dequantize(quantize(w[:1], "q4_1")), dequantize(quantize(w[1:], "q8_0"))])
    )


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_quantized_tiny_model_computes_what_its_dequantized_weights_compute(tiny, kind) -> None:
    from mechserve.model.llama import LlamaModel

    quantized = load_model(str(tiny.path), tokenizer=False, quantization=kind).model
    assert quantized.quantization == kind and quantized.dtype == torch.float32
    assert quantized.layers[0].qkv.kind == kind and quantized.embed.kind == "q8_0"  # the embedding as the file keeps it
    # the same model with every matrix replaced by its dequantized floats
    plain = LlamaModel.__new__(LlamaModel)
    plain.__dict__.update(quantized.__dict__)
    plain.embed = dequantize(quantized.embed)
    plain.lm_head = dequantize(quantized.lm_head)
    plain.layers = []
    for w in quantized.layers:
        import dataclasses

        plain.layers.append(
            dataclasses.replace(
                w, qkv=dequantize(w.qkv), o=dequantize(w.o), gate_up=dequantize(w.gate_up), down=dequantize(w.down)
            )
        )
    from mechserve.kv.paged import Span, build_attention_batch

    ids = torch.tensor([5, 9, 17, 33, 2])
    pos = torch.arange(5)
    spans = [Span(0, 0, 5, [0, 1])]
    for model in (quantized, plain):
        cache = model.new_cache(2, 4)
        batch = build_attention_batch(spans, list(range(5)), 4, 2, model.distinct_sliding_windows)
        out = model.forward(ids, pos, cache, batch, torch.arange(5))
        if model is quantized:
            first = out
    torch.testing.assert_close(first, out, rtol=1e-4, atol=1e-4)


def test_an_engine_runs_quantized_and_refuses_a_mismatch(tiny) -> None:
    from mechserve.api.params import SamplingParams
    from mechserve.engine.core import EngineCore

    quantized = load_model(str(tiny.path), tokenizer=False, quantization="q8_0")
    core = EngineCore(quantized, EngineConfig(quantization="q8_0", num_pages=16, page_size=4))
    core.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    (done,) = core.run_until_idle()
    assert len(done.outputs[0].token_ids) == 6
    loaded = load_model(str(tiny.path), tokenizer=False)
    with pytest.raises(ValueError, match="quantization None but the config asks for q8_0"):
        EngineCore(loaded, EngineConfig(quantization="q8_0", num_pages=16, page_size=4))


def test_the_config_takes_a_quantization_or_says_why_not() -> None:
    assert EngineConfig(quantization="Q4_1").quantization == "q4_1"
    assert EngineConfig.from_args(quantization="q8_0", dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="quantization must be None or one of q4_1, q8_0"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="dtype float32 or bfloat16, not float16"):
        EngineConfig(quantization="q4_1", dtype="float16")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(quantization="q4_1", world_size=2)


@pytest.mark.e2e
def test_the_embedded_q4_1_file_is_read_as_it_is_stored() -> None:
    """Its blocks dequantize to exactly the float32 weights mechserve converted from it, and ggml's
    rounding applied to those weights gives back the same blocks."""
    from mechserve.model.checkpoint import embedded_gguf, resolve_model
    from mechserve.model.formats import SafetensorsFiles, gguf_matrices

    blocks = gguf_matrices(embedded_gguf(), 9, 3)
    with SafetensorsFiles(resolve_model("smollm2"), torch.float32) as files:
        floats = {name: files.read(name) for name in blocks}
    assert len(blocks) == 30 * 7 + 1
    assert blocks["model.embed_tokens.weight"].kind == "q8_0"
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ):
        assert torch.equal(dequantize(blocks[name]), floats[name]), name
    k = blocks["model.layers.7.self_attn.k_proj.weight"]
    assert torch.equal(quantize(floats["model.layers.7.self_attn.k_proj.weight"], k.kind).blocks, k.blocks)
