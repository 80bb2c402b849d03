"""GGUF files as models (``--model file.gguf``): tiny files written here (tests/gguf_models.py) loaded and run
against transformers on the weights their blocks decode to; every refusal before any work; tokenizers
from the metadata against their references."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import bpe_vocab, spm_vocab, tiny_hf, write_gguf

from mechserve.api.errors import ModelLoadError
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model import gguf_model
from mechserve.model.gguf_file import GGUFFile
from mechserve.model.loader import load_model
from mechserve.model.quantized import QuantizedMatrix

TEXT = (Path(__file__).parents[2] / "mechserve" / "bench" / "data" / "declaration-of-independence.txt").read_text()
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def mixed(name: str, shape: tuple[int, ...]) -> str:
    """Q4_K_M-like: K-quants where rows are whole 256-blocks, the 32-blocks elsewhere, one of each per layer."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    table = {
        "q_proj": ("q4_k", "q5_k"),
        "k_proj": ("q6_k", "q4_0"),
        "v_proj": ("q5_0", "q8_0"),
        "o_proj": ("q5_1", "f16"),
        "gate_proj": ("q4_1", "q4_k"),
        "up_proj": ("bf16", "q6_k"),
        "down_proj": ("f32", "q5_k"),
    }
    for part, kinds in table.items():
        if part in name:
            return kinds[layer]
    return "q6_k" if "embed" in name else "q8_0"


def forward_logits(model: Any, ids: list[int]) -> torch.Tensor:
    page = 16
    cache = model.new_cache(-(-len(ids) // page), page)
    table = list(range(cache.num_pages))
    a = model.arch
    batch = build_attention_batch(
        [Span(0, 0, len(ids), table)],
        list(range(len(ids))),
        page,
        a.num_heads // a.num_kv_heads,
        model.distinct_sliding_windows,
    )
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, batch, None)


def decode_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Every position's logits computed one row at a time (decode steps: the few-row kernel)."""
    page = 16
    cache = model.new_cache(-(-len(ids) // page), page)
    table = list(range(cache.num_pages))
    a = model.arch
    rows = []
    for p, t in enumerate(ids):
        batch = build_attention_batch(
            [Span(0, p, 1, table)], [p], page, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows
        )
        rows.append(model.forward(torch.tensor([t]), torch.tensor([p]), cache, batch, None))
    return torch.cat(rows)


def reference_logits(hf: Any, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    hf.load_state_dict(state, strict=False)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory):
    return bpe_vocab(tmp_path_factory.mktemp("bpe"))


CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_mixed_format_file_computes_what_transformers_computes_on_its_decoded_weights(tmp_path, bpe, case) -> None:
    arch, overrides = CASES[case]
    hf = tiny_hf(arch, vocab_size=len(bpe.tokens), **overrides)
    path = tmp_path / "m.gguf"
    state = write_gguf(path, hf, arch, mixed, bpe, chat_template=TEMPLATE)
    loaded = load_model(str(path), dtype=torch.float32)
    m = loaded.model
    # q, k, v in three formats fused as each is stored; up in BF16 stays blocks beside float32 activations
    assert m.layers[0].qkv.segments == (("q4_k", 256), ("q6_k", 128), ("q5_0", 128))
    assert m.layers[1].qkv.segments == (("q5_k", 256), ("q4_0", 128), ("q8_0", 128))
    assert m.layers[0].gate_up.segments == (("q4_1", 512), ("bf16", 512))
    assert isinstance(m.layers[0].down, torch.Tensor) and m.layers[0].down.dtype == torch.float32  # F32 as floats
    assert m.embed.kind == "q6_k" and isinstance(m.embed, QuantizedMatrix)
    ids = [int(i) for i in torch.randint(0, len(bpe.tokens), (21,), generator=torch.Generator().manual_seed(3))]
    want = reference_logits(hf, state, ids)
    torch.testing.assert_close(forward_logits(m, ids), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_logits(m, ids), want, rtol=1e-4, atol=1e-4)
    if arch != "qwen3":
        assert m.native_layers  # the decode steps above ran the fused native blocks
    fast = load_model(str(path), dtype=torch.bfloat16, tokenizer=False).model
    # bfloat16 rounds through every layer: each logit within 0.05 of the float32 reference's (they reach ~3),
    # so a position whose reference leads by more than 0.1 keeps its greedy token (a near-tie may flip: the
    # kernels' and torch's bfloat16 orders of summation differ, and both are right)
    got = forward_logits(fast, ids).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert clear.sum() >= len(ids) // 2 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_llama3_rope_factors_and_linear_scaling(tmp_path, bpe) -> None:
    """Llama 3's ``rope_freqs.weight`` divides the frequencies (as llama.cpp); linear scaling from metadata."""
    hf = tiny_hf(
        "llama",
        vocab_size=len(bpe.tokens),
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, torch.device("cpu"))
    base = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    factors = base / inv  # what llama.cpp's converter writes
    path = tmp_path / "m.gguf"
    state = write_gguf(path, hf, "llama", "q8_0", bpe, rope_freqs=factors)
    m = load_model(str(path), tokenizer=False).model
    ids = list(range(3, 60))
    torch.testing.assert_close(forward_logits(m, ids), reference_logits(hf, state, ids), rtol=1e-4, atol=1e-4)

    hf = tiny_hf(
        "llama",
        vocab_size=len(bpe.tokens),
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    )
    path = tmp_path / "linear.gguf"
    state = write_gguf(
        path,
        hf,
        "llama",
        "q8_0",
        bpe,
        metadata={"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0},
    )
    m = load_model(str(path), tokenizer=False).model
    assert m.config.rope_parameters["rope_type"] == "linear"
    torch.testing.assert_close(forward_logits(m, ids), reference_logits(hf, state, ids), rtol=1e-4, atol=1e-4)


def test_the_config_comes_from_the_metadata(tmp_path, bpe) -> None:
    hf = tiny_hf("qwen3", vocab_size=len(bpe.tokens), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "qwen3", "q4_k", bpe)
    c = gguf_model.gguf_config(GGUFFile.open(path))
    assert c.model_type == "qwen3" and c.architectures == ["Qwen3ForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.head_dim) == (256, 512, 2, 64)
    assert (c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (4, 2, 256)
    assert c.rope_parameters["rope_theta"] == 5e5 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings is False and c.vocab_size == len(bpe.tokens)


# Refusals, each before any work ----------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a weight or the tokenizer is read: every refusal comes first."""

    def read(*_a, **_k):
        raise AssertionError("a weight was read before the file was refused")

    def tok(*_a, **_k):
        raise AssertionError("the tokenizer was built before the file was refused")

    monkeypatch.setattr(GGUFFile, "read", read)
    monkeypatch.setattr(gguf_model, "gguf_tokenizer", tok)


def test_an_unknown_architecture_is_named(tmp_path, bpe, no_work) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "gemma2", "q8_0", bpe)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gemma2'.*supported: llama, qwen2, qwen3"):
        load_model(str(path))


def test_a_truncated_file_names_the_tensor(tmp_path, bpe, no_work) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q4_k", bpe)
    whole = path.read_bytes()
    path.write_bytes(whole[:-1000])
    with pytest.raises(
        ModelLoadError, match=r"is truncated: tensor '[\w.]+' needs bytes \[\d+, \d+\) but the file has"
    ):
        load_model(str(path))
    path.write_bytes(whole[:200])  # inside the metadata
    with pytest.raises(ModelLoadError, match="is truncated: its GGUF header ends early"):
        load_model(str(path))


def test_an_unsupported_tensor_type_is_named(tmp_path, bpe, no_work) -> None:
    import gguf

    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"

    def kinds(name: str, shape: tuple[int, ...]) -> str:
        return "q4_k"

    write_gguf(path, hf, "llama", kinds, bpe, skip=("model.layers.1.mlp.down_proj.weight",))
    # rewrite with a Q2_K tensor in its place (random blocks of the right size: never decoded)
    reader = GGUFFile.open(path)
    assert "blk.1.ffn_down.weight" not in reader.tensors
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    _copy_metadata(reader, w)
    import numpy as np

    for t in reader.tensors.values():
        data = np.fromfile(path, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.rows, -1)
        if t.type_name == "F32":
            w.add_tensor(t.name, data.view(np.float32).reshape(t.shape))
        else:
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[t.type_name])
    q2 = np.zeros((256, 512 // 256 * 84), dtype=np.uint8)
    w.add_tensor("blk.1.ffn_down.weight", q2, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_down.weight' is Q2_K, a type mechserve does not run"):
        load_model(str(tmp_path / "q2.gguf"))


def _copy_metadata(reader: GGUFFile, w: Any) -> None:
    import gguf

    for key, value in reader.metadata.items():
        if key in ("general.architecture", "GGUF.version"):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)


def test_an_unknown_type_number_and_an_unknown_tensor_are_named(tmp_path, bpe, no_work) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", bpe)
    f = GGUFFile.open(path)
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 99)  # the type number
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(
        ModelLoadError, match=r"tensor 'blk.0.attn_q.weight' has tensor type 99, which is not a ggml type"
    ):
        load_model(str(bad))
    fused_name = bytearray(path.read_bytes())
    at = fused_name.index(b"blk.0.attn_q.weight")
    fused_name[at : at + len(name)] = b"blk.0.attn_qkvweight"[: len(name)]
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(fused_name))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_qkvweigh' is not part of a llama model"):
        load_model(str(odd))
    assert f.architecture == "llama"


def test_not_a_gguf_and_the_options_a_gguf_refuses(tmp_path, bpe) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"model\.gguf is not a GGUF file \(104 bytes, starting b'GGML"):
        load_model(str(fake))
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q4_0", bpe)
    with pytest.raises(ModelLoadError, match="quantization q4_1 applies to Hugging Face directories"):
        load_model(str(path), quantization="q4_1")
    with pytest.raises(ModelLoadError, match="runs in one process"):
        load_model(str(path), weights=False)
    with pytest.raises(ModelLoadError, match="float32 or bfloat16, not float16"):
        load_model(str(path), dtype=torch.float16)
    version = bytearray(path.read_bytes())
    struct.pack_into("<I", version, 4, 7)
    (tmp_path / "v7.gguf").write_bytes(bytes(version))
    with pytest.raises(ModelLoadError, match="is GGUF version 7; mechserve reads versions 2 and 3"):
        load_model(str(tmp_path / "v7.gguf"))


def test_a_special_token_id_outside_the_vocabulary_is_named(tmp_path, bpe, no_work) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", bpe, metadata={"tokenizer.ggml.eot_token_id": 31232})
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.eot_token_id is 31232, not an id of its \d+-token"):
        load_model(str(path))


def test_damaged_header_bytes_are_one_model_load_error_or_a_valid_file(tmp_path, bpe) -> None:
    """Random bytes of the header and metadata overwritten, 300 seeded times: opening, checking and reading the
    config either succeed or raise ``ModelLoadError`` (never a struct, numpy, Unicode or transformers error)."""
    import random

    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q4_k", bpe)
    whole = path.read_bytes()
    header = min(t.offset for t in GGUFFile.open(path).tensors.values())
    rng = random.Random(30)
    refused = 0
    for _ in range(300):
        raw = bytearray(whole)
        for _ in range(rng.choice([1, 2, 4])):
            raw[rng.randrange(header)] = rng.randrange(256)
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(bytes(raw))
        try:
            f = GGUFFile.open(bad)
            gguf_model.gguf_config(f)
        except ModelLoadError as exc:
            assert str(bad) in str(exc) or "GGUF" in str(exc)
            refused += 1
    assert refused > 100  # most damage is seen


def test_the_cli_refuses_a_bad_file_in_one_line(tmp_path, bpe) -> None:
    import subprocess
    import sys

    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "phi3", "q8_0", bpe)
    done = subprocess.run(
        [sys.executable, "-m", "mechserve", "generate", "--model", str(path), "hello"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported GGUF architecture 'phi3'" in lines[0], done.stderr


# Tokenizers from the metadata -------------------------------------------------------------------------------------


def test_a_bpe_vocabulary_tokenizes_as_its_source_tokenizer(tmp_path, bpe) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", bpe, chat_template=TEMPLATE)
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    for text in (TEXT[:2000], 'true, "x": {"tru": true}', "  spaces\n\nand\ttabs <|endoftext|>"):
        assert tok(text, add_special_tokens=False).input_ids == bpe.reference(text), text[:40]
    assert tok.chat_template == TEMPLATE
    assert loaded.eos_token_ids == (0,)
    from mechserve.entrypoints.prompts import Chat, encode_chat

    text, ids = encode_chat(tok, Chat([{"role": "user", "content": "hi"}]))
    assert text == "<user>hi<a>" and ids == tok("<user>hi<a>", add_special_tokens=False).input_ids


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path) -> None:
    vocab = spm_vocab(tmp_path, TEXT)
    hf = tiny_hf("llama", vocab_size=len(vocab.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", vocab)
    tok = load_model(str(path)).tokenizer
    lines = [line for line in TEXT.splitlines() if line.strip()][:40]
    for text in [*lines, TEXT[:3000], "Naïve café ✓ 1776"]:
        assert tok(text).input_ids == vocab.reference(text), text[:40]


def test_eos_ids_are_llama_cpps(tmp_path, bpe) -> None:
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", bpe, metadata={"tokenizer.ggml.eot_token_id": 5})
    f = GGUFFile.open(path)
    assert gguf_model.gguf_eos_ids(f) == (0, 5)  # EOS, then EOT (and any <|im_end|>-like token text)


@pytest.mark.parametrize(
    ("pre", "want"),
    [
        # llama-tokenize's ids for "a 12 x123 1212" with these files (llama.cpp 0.3.36's sdist, checked once):
        # "smollm" splits digits one by one before the byte-level regex, so no digit merge applies
        ("smollm", [65, 221, 17, 18, 221, 88, 17, 18, 19, 221, 17, 18, 17, 18]),
        ("gpt-2", [65, 221, 265, 221, 88, 265, 19, 221, 265, 265]),
    ],
)
def test_llama_cpps_pre_tokenizer_is_honoured(tmp_path, pre, want) -> None:
    """transformers' GGUF tokenizer has no ``smollm`` split; without ours, SmolLM-style files would merge digits
    that llama.cpp keeps apart."""
    import dataclasses

    vocab = bpe_vocab(tmp_path)
    vocab = dataclasses.replace(
        vocab,
        tokens=[*vocab.tokens, "12", "Ġ1"],
        types=[*vocab.types, 1, 1],
        merges=[*vocab.merges, "1 2", "Ġ 1"],
        pre=pre,
    )
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf("llama", vocab_size=len(vocab.tokens)), "llama", "q8_0", vocab)
    tok = load_model(str(path)).tokenizer
    assert tok("a 12 x123 1212").input_ids == want


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_tokenize_on_a_few_hundred_strings(tmp_path) -> None:
    """A SentencePiece GGUF against ``llama-tokenize``'s ids on the same vocabulary (``spm_vocab_gguf``),
    pinned in ``tests/data/llama-tokenize-spm.json`` (written by ``tests/data/llama_tokenize_spm_cases.py``):
    llama.cpp prefixes every text piece that starts the text or follows a special token with a space, so
    ``' Hello  world'``, ``'<s>hi</s>'``, ``'<s>[INST] hi [/INST]'`` and ``'   '`` (issue 30) tokenize as there,
    as do whitespace runs, leading and trailing spaces, many scripts and byte fallback."""
    import json
    import sys

    data = Path(__file__).parents[1] / "data"
    sys.path.insert(0, str(data))
    try:
        from llama_tokenize_spm_cases import spm_vocab_gguf
    finally:
        sys.path.remove(str(data))
    doc = json.loads((data / "llama-tokenize-spm.json").read_text("utf-8"))
    assert len(doc["cases"]) >= 250
    tok = gguf_model.gguf_tokenizer(GGUFFile.open(spm_vocab_gguf(tmp_path / "spm.gguf")))
    differ = [c["text"] for c in doc["cases"] if tok(c["text"]).input_ids != c["ids"]]
    assert differ == []
    by_text = {c["text"]: c["ids"] for c in doc["cases"]}
    assert by_text["<s>hi</s>"][:2] == [1, 1] and by_text["<s>hi</s>"][-1] == 2  # the specials parsed
    assert len(by_text["   "]) == 2  # BOS, then one piece for four U+2581


@pytest.mark.parametrize(
    ("model", "pre", "key", "want_bos"),
    [
        ("gpt2", "llama-bpe", None, True),  # Llama 3 without the key: llama.cpp adds BOS
        ("gpt2", "gpt-2", None, False),
        ("gpt2", "qwen2", None, False),
        ("gpt2", "llama-bpe", False, False),  # the file's key wins
        ("gpt2", "gpt-2", True, True),
        ("llama", "default", None, True),  # SentencePiece: BOS by default
        ("llama", "default", False, False),
    ],
)
def test_bos_is_added_as_llama_cpp_adds_it(tmp_path, bpe, model, pre, key, want_bos) -> None:
    """``tokenizer.ggml.add_bos_token`` when the file has it, else llama.cpp's default for the vocabulary
    and pre-tokenizer (llama-vocab.cpp ``load``): Llama 3's BPE vocabulary without the key got no BOS."""
    import gguf

    if model == "gpt2":
        tokens, types, bos = [*bpe.tokens, "<|begin_of_text|>"], [*bpe.types, 3], len(bpe.tokens)
    else:
        tokens = [
            "<unk>",
            "<s>",
            "</s>",
            *[f"<0x{b:02X}>" for b in range(256)],
            "\u2581",
            "h",
            "i",
            "\u2581h",
            "\u2581hi",
        ]
        types, bos = [2, 3, 3, *[6] * 256, 1, 1, 1, 1, 1], 1
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if model == "gpt2":
        w.add_token_merges(bpe.merges)
    else:
        w.add_token_scores([0.0] * (len(tokens) - 5) + [-1.0, -2.0, -3.0, -4.0, -5.0])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(bos + 1 if model == "llama" else 0)
    if key is not None:
        w.add_add_bos_token(key)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ids = gguf_model.gguf_tokenizer(GGUFFile.open(tmp_path / "v.gguf"))("hi").input_ids
    assert (ids[:1] == [bos]) == want_bos and bos not in ids[1:]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "run", "--model", "{bad}", "--out", "{tmp}/b"], "{bad} is not a GGUF file (104 bytes"),
        (["generate", "--model", "{bad}", "hi"], "{bad} is not a GGUF file (104 bytes"),
        (["generate", "--model", "{tmp}/nonexistent.gguf", "hi"], "model not found: {tmp}/nonexistent.gguf (a"),
        (["generate", "--model", "{good}", "--chat", "hi"], "--chat: the model has no chat template; give one with"),
    ],
)
def test_a_model_that_does_not_load_is_one_line_not_an_internal_error(tmp_path, bpe, argv, says) -> None:
    """Issue 30: ``bench run --model badmagic.gguf`` said "internal error: ModelLoadError: ..."; ``generate
    --chat`` on a GGUF without a template said "pass chat_template=" (Python's name, not the CLI's flag)."""
    import subprocess
    import sys

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    good = tmp_path / "m.gguf"
    write_gguf(good, tiny_hf("llama", vocab_size=len(bpe.tokens)), "llama", "q8_0", bpe)
    names = {"bad": bad, "good": good, "tmp": tmp_path}
    argv = [a.format(**names) for a in argv]
    done = subprocess.run([sys.executable, "-m", "mechserve", *argv], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert says.format(**names) in lines[0] and "internal error" not in lines[0] and "Error:" not in lines[0]


def test_a_missing_tensor_is_named_by_its_gguf_name_before_the_tokenizer(tmp_path, bpe, no_work) -> None:
    """Issue 30: a GGUF missing a tensor named only the Hugging Face name, and only after building the
    tokenizer (a vocab-only file took 98 s to refuse); ``no_work`` fails the test if either is read first."""
    hf = tiny_hf("llama", vocab_size=len(bpe.tokens))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", "q8_0", bpe, skip=("model.layers.1.self_attn.k_proj.weight",))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    assert str(err.value) == (
        f"{path} is missing tensor blk.1.attn_k.weight (model.layers.1.self_attn.k_proj.weight)"
    ), err.value
