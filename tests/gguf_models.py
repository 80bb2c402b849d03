"""Tiny GGUF files the tests write themselves (gguf-py's ``GGUFWriter``), so no test needs llama.cpp.

``write_gguf(path, hf, arch, kinds, vocab)`` writes a random-weight transformers model as llama.cpp's
converter would: llama.cpp's tensor names and metadata keys, q/k rows permuted for ``llama``
(``permute_rows``, the inverse of what the loader undoes), each matrix in the block format ``kinds``
chooses (encoded by ``mechserve.model.kquants``/``quantized``, whose blocks the tests check against
gguf-py's reference decoder), norms in F32.  ``dequantized_state`` gives the float weights those
blocks stand for, for a transformers reference.  Two vocabularies: ``bpe_vocab`` (byte-level BPE,
``tiny_models.save_byte_tokenizer``'s) and ``spm_vocab`` (a SentencePiece model trained here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# llama.cpp's tensor names per Hugging Face name (the inverse of gguf_model's map).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def permute_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: GGUF row ``h*D + 2*i + j`` is HF row ``h*D + j*D/2 + i``."""
    d = rows // heads
    return torch.arange(rows).reshape(heads, 2, d // 2).transpose(1, 2).reshape(-1)


@dataclass
class Vocab:
    """A GGUF tokenizer: ``model`` (``gpt2`` or ``llama``), tokens in id order, their types (1 normal, 2
    unknown, 3 control, 6 byte), merges or scores, special ids, and the reference to compare with."""

    model: str
    tokens: list[str]
    types: list[int]
    bos: int | None
    eos: int
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    pre: str | None = None
    unk: int | None = None
    add_bos: bool = False
    add_space_prefix: bool = False
    reference: Any = None  # encode(text) -> ids, what the GGUF tokenizer must give


def bpe_vocab(tmp: Path) -> Vocab:
    """``tiny_models.save_byte_tokenizer``'s byte-level BPE (EOS ``<|endoftext|>`` = 0) as GGUF metadata;
    its reference is that tokenizer itself."""
    from tiny_models import save_byte_tokenizer

    fast = save_byte_tokenizer(tmp / "bpe")
    vocab = fast.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in _merges(fast)]
    types = [3 if t == "<|endoftext|>" else 1 for t in tokens]
    return Vocab(
        "gpt2",
        tokens,
        types,
        bos=None,
        eos=0,
        merges=merges,
        pre="gpt-2",
        reference=lambda text: fast(text, add_special_tokens=False).input_ids,
    )


def _merges(fast: Any) -> list[tuple[str, str]]:
    import json

    model = json.loads(fast.backend_tokenizer.to_str())["model"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def spm_vocab(tmp: Path, text: str, size: int = 320) -> Vocab:
    """A SentencePiece BPE model trained on ``text`` as Llama's and Mistral's are (byte fallback, identity
    normalization, whitespace kept, a dummy prefix), as GGUF's ``llama`` vocabulary; its reference is
    sentencepiece itself with a BOS first."""
    import sentencepiece as spm

    prefix = tmp / "spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
        model_prefix=str(prefix),
        vocab_size=size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        # as Llama's tokenizer.model: no normalization, whitespace kept (llama.cpp normalizes nothing either)
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return Vocab(
        "llama",
        tokens,
        types,
        bos=1,
        eos=2,
        scores=scores,
        unk=0,
        add_bos=True,
        add_space_prefix=True,
        reference=lambda t: [1, *sp.encode(t)],
    )


def quantize_as(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """``weight`` [N, K] in ``kind`` as the array and ggml type ``GGUFWriter.add_tensor`` takes."""
    from gguf import GGMLQuantizationType as T

    from mechserve.model.quantized import quantize

    if kind == "f32":
        return weight.float().numpy(), None
    if kind == "f16":
        return weight.half().numpy(), None
    q = quantize(weight.float(), kind)
    types = {
        "bf16": T.BF16,
        "q4_0": T.Q4_0,
        "q4_1": T.Q4_1,
        "q5_0": T.Q5_0,
        "q5_1": T.Q5_1,
        "q8_0": T.Q8_0,
        "q4_k": T.Q4_K,
        "q5_k": T.Q5_K,
        "q6_k": T.Q6_K,
    }
    return q.blocks.numpy(), types[kind]


def dequantized(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 values ``weight`` has once stored in ``kind`` (gguf-py's reference decoder)."""
    from mechserve.model.quantized import dequantize, quantize

    if kind == "f32":
        return weight.float()
    if kind == "f16":
        return weight.half().float()
    return dequantize(quantize(weight.float(), kind))


Kinds = Callable[[str, tuple[int, ...]], str]


def write_gguf(
    path: Path,
    hf: Any,
    arch: str,
    kinds: Kinds | str,
    vocab: Vocab,
    *,
    chat_template: str | None = None,
    rope_freqs: torch.Tensor | None = None,
    metadata: dict[str, Any] | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Write ``hf`` (a transformers causal LM) as a GGUF of architecture ``arch`` at ``path``.

    ``kinds(hf_name, shape)`` (or one kind for every matrix) picks each matrix's format; vectors are
    F32.  ``metadata`` adds or overrides keys (``{arch}`` replaced); ``skip`` leaves tensors out.
    Returns the state dict with every matrix replaced by what its blocks decode to (the model the
    file describes, for a transformers reference).
    """
    import gguf

    c = hf.config
    choose: Kinds = (lambda _n, _s: kinds) if isinstance(kinds, str) else kinds
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.scores:
        w.add_token_scores(vocab.scores)
    if vocab.bos is not None:
        w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        w.add_unk_token_id(vocab.unk)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_space_prefix(vocab.add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        key = key.replace("{arch}", arch)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    decoded: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in skip:
            continue
        if tensor.dim() == 1:
            w.add_tensor(gguf_name(name), tensor.float().numpy())
            decoded[name] = tensor.float()
            continue
        kind = choose(name, tuple(tensor.shape))
        stored = tensor.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            stored = stored[permute_rows(stored.shape[0], heads)]
        array, raw = quantize_as(stored, kind)
        w.add_tensor(gguf_name(name), array, raw_dtype=raw)
        decoded[name] = dequantized(tensor, kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if c.tie_word_embeddings and "lm_head.weight" in hf.state_dict():
        decoded["lm_head.weight"] = decoded["model.embed_tokens.weight"]
    return decoded


def tiny_hf(model_type: str = "llama", vocab_size: int = 272, seed: int = 0, **overrides: Any) -> Any:
    """A 2-layer random transformers model wide enough for K-quant rows: hidden 256, MLP 512, 4 heads of 64
    over 2 KV heads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
