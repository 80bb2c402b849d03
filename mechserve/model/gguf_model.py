"""A GGUF file as a mechserve model (``--model path/to/file.gguf``): its config, tokenizer, EOS ids and weights.

The file is opened and checked first (``gguf_file.GGUFFile``: a GGUF, whole), then ``check_model``
refuses, before any weight is read, a file whose

* ``general.architecture`` is not one of ``ARCHITECTURES`` (GGUF's names: ``llama`` -- Llama 1-3,
  Mistral and Mixtral-free Mistral derivatives, SmolLM, TinyLlama, all written as ``llama`` by
  llama.cpp's converter --, ``qwen2``, ``qwen3``),
* tensors include one the weight map does not know (a fused ``attn_qkv``, experts, ...),
* tensors have a type mechserve does not run (``KINDS``: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
  Q8_0, Q4_K, Q5_K, Q6_K; not Q2_K, Q3_K, the IQ types, ...),
* settings this forward cannot honour (partial rotary embeddings, per-layer KV head counts, a RoPE
  scaling type other than none/linear/yarn).

**Config** (``gguf_config``): llama.cpp's metadata keys as transformers config fields::

    {arch}.embedding_length -> hidden_size            {arch}.feed_forward_length -> intermediate_size
    {arch}.block_count -> num_hidden_layers           {arch}.context_length -> max_position_embeddings
    {arch}.attention.head_count(_kv) -> num_(key_value_)heads
    {arch}.attention.key_length -> head_dim           {arch}.attention.layer_norm_rms_epsilon -> rms_norm_eps
    {arch}.rope.freq_base -> rope_theta               {arch}.rope.scaling.{type,factor,original_context_length}
    token count (or {arch}.vocab_size) -> vocab_size  no output.weight -> tie_word_embeddings
    attn_q.bias / attn_output.bias / ffn_gate.bias present -> attention_bias / o bias / mlp_bias (llama)

Llama 3's RoPE frequency factors are a tensor (``rope_freqs.weight``), by which the model's inverse
frequencies are divided as llama.cpp does (``apply_rope_freqs``).  A Mistral file is ``llama`` and,
as llama.cpp runs it, without a sliding window.

**Tokenizer** (``gguf_tokenizer``): transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``: BPE ``gpt2`` and SentencePiece ``llama`` vocabularies, control and user-defined
tokens, ``tokenizer.chat_template``), with the pre-tokenizer of llama.cpp's ``tokenizer.ggml.pre``
where transformers has none for it (``PRE_TOKENIZERS``), so the ids are llama.cpp's.

**Weights** (``GGUFTensors``): under Hugging Face names, read from the file when asked for (one
matrix at a time, so loading holds one layer's parts beside the model, never a second model).  A
matrix is kept as the file stores it (``QuantizedMatrix`` of its kind) unless its type is the
activations' dtype (F32 with float32, BF16 with bfloat16: a plain tensor); the q and k rows of a
``llama`` file are put back in Hugging Face's order (llama.cpp's converter interleaves each head's
RoPE halves).  Norms and biases are floats of the activations' dtype.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.gguf_file import GGUFFile, GGUFTensor
from mechserve.model.quantized import QuantizedMatrix, dequantize

# GGUF architecture -> (Hugging Face model_type, class name): the families the forward runs.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# ggml type name -> the kind a matrix of it is kept as.
KINDS = {
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "Q4_0": "q4_0",
    "Q4_1": "q4_1",
    "Q5_0": "q5_0",
    "Q5_1": "q5_1",
    "Q8_0": "q8_0",
    "Q4_K": "q4_k",
    "Q5_K": "q5_k",
    "Q6_K": "q6_k",
}
# The weight map (llama.cpp's tensor names, gguf-py's TensorNameMap): model-wide and per layer.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's per-frequency factors
# llama.cpp's pre-tokenizers that transformers' GGUF tokenizer does not set: their split (before the
# byte-level step), from llama-vocab.cpp's regex lists.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZERS = {
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
}
# Token texts llama.cpp ends generation at wherever a vocabulary has them (llama-vocab.cpp, "special_eog_ids").
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
)


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for one the map does not know."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    return None


def check_model(f: GGUFFile) -> None:
    """Raise ``ModelLoadError`` unless ``f`` is a model this forward runs (module docstring): its
    architecture, every tensor's name and type, and its layers' count."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        name = f.get("general.name")
        said = f" ({name})" if isinstance(name, str) and name else ""
        raise ModelLoadError(
            f"{f.path}: unsupported GGUF architecture {arch or '(none)'!r}{said}; supported: {supported()} "
            "(a Mistral or SmolLM file is 'llama')"
        )
    layers = _int(f, "{arch}.block_count")
    for t in f.tensors.values():
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name)
        if name is None or (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers):
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} is not part of a {arch} model as mechserve runs it "
                f"(its layers are blk.0..blk.{layers - 1}: attention, norms and a SwiGLU MLP)"
            )
        if t.type_name not in KINDS:
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} is {t.type_name}, a type mechserve does not run; "
                f"supported: {', '.join(KINDS)}"
            )


def _int(f: GGUFFile, key: str, default: int | None = None) -> int:
    value = f.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = key.replace("{arch}", f.architecture)
        raise ModelLoadError(f"{f.path}: metadata {where} must be a whole number >= 1, got {value!r}")
    return value


def _float(f: GGUFFile, key: str, default: float | None = None) -> float:
    value = f.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        where = key.replace("{arch}", f.architecture)
        raise ModelLoadError(f"{f.path}: metadata {where} must be a number > 0, got {value!r}")
    return float(value)


def gguf_config(f: GGUFFile) -> Any:
    """The transformers config of ``f``'s model (module docstring's table).  Raises ``ModelLoadError``."""
    from transformers import AutoConfig

    check_model(f)
    model_type, cls_name = ARCHITECTURES[f.architecture]
    hidden = _int(f, "{arch}.embedding_length")
    heads = _int(f, "{arch}.attention.head_count")
    kv_heads = f.get("{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{f.path}: per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    head_dim = _int(f, "{arch}.attention.key_length", hidden // heads)
    if _int(f, "{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{f.path}: keys and values of different widths are not supported")
    rotary = _int(f, "{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"{f.path}: RoPE on {rotary} of {head_dim} head dimensions (partial rotary) is not supported"
        )
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.get("{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(f, "{arch}.rope.freq_base", 10000.0)}
    scaling = f.get("{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=_float(f, "{arch}.rope.scaling.factor"))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = _int(f, "{arch}.rope.scaling.original_context_length")
    elif scaling != "none":
        raise ModelLoadError(f"{f.path}: RoPE scaling {scaling!r} is not supported (none, linear, yarn)")
    layer0 = {t.name.split(".", 2)[2] for t in f.tensors.values() if t.name.startswith("blk.0.")}
    fields: dict[str, Any] = dict(
        architectures=[cls_name],
        hidden_size=hidden,
        intermediate_size=_int(f, "{arch}.feed_forward_length"),
        num_hidden_layers=_int(f, "{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(f, "{arch}.context_length"),
        rms_norm_eps=_float(f, "{arch}.attention.layer_norm_rms_epsilon"),
        vocab_size=vocab,
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in f.tensors,
        hidden_act="silu",
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
    )
    if model_type == "llama":
        fields.update(attention_bias="attn_q.bias" in layer0, mlp_bias="ffn_gate.bias" in layer0)
    if model_type == "qwen3":
        fields["attention_bias"] = "attn_q.bias" in layer0
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' checks raise many types; each is the file's metadata's fault
        raise ModelLoadError(f"{f.path}: its metadata is not a valid {model_type} config: {exc}") from None


def gguf_tokenizer(f: GGUFFile) -> Any:
    """The tokenizer of ``f`` (module docstring), with its chat template.  Raises ``ModelLoadError``."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    kind = f.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{f.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2: byte-level BPE, llama: SentencePiece)"
        )
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress lines
            tok = AutoTokenizer.from_pretrained(f.path.parent, gguf_file=f.path.name)
    except Exception as exc:
        raise ModelLoadError(f"{f.path}: cannot build its tokenizer: {exc}") from None
    splits = PRE_TOKENIZERS.get(f.get("tokenizer.ggml.pre", ""))
    if splits is not None:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return tok


def gguf_eos_ids(f: GGUFFile) -> tuple[int, ...]:
    """The ids generation ends at, as llama.cpp decides them: the file's EOS, EOT and EOM ids, then every
    token whose text is one of ``EOG_TEXTS``."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = f.get(key)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    tokens = f.get("tokenizer.ggml.tokens") or []
    for i, text in enumerate(tokens):
        if text in EOG_TEXTS and i not in ids:
            ids.append(i)
    return tuple(ids)


class GGUFTensors(Mapping[str, Any]):
    """The tensors of a checked GGUF file under Hugging Face names, read from the file when looked up
    (nothing is cached): matrices as the file stores them, vectors as floats of ``dtype`` (module
    docstring).  Raises ``ModelLoadError`` when a read fails."""

    def __init__(self, f: GGUFFile, config: Any, dtype: torch.dtype) -> None:
        self.file, self.config, self.dtype = f, config, dtype
        self._names = {hf: t for t in f.tensors.values() if (hf := hf_name(t.name)) is not None}
        self._permute = f.architecture == "llama"  # llama.cpp's converter permuted q/k for its NORM RoPE

    def __getitem__(self, name: str) -> Any:
        t = self._names[name]
        raw = self.file.read(t.name)
        if len(t.shape) == 1:
            return self._vector(t, raw)
        value = self._matrix(t, raw)
        if self._permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_attention_heads if "q_proj" in name else self.config.num_key_value_heads
            order = unpermute_rows(t.shape[0], heads)
            if isinstance(value, QuantizedMatrix):
                value = QuantizedMatrix(value.kind, value.blocks.index_select(0, order), value.in_features)
            else:
                value = value.index_select(0, order)
        return value

    def _vector(self, t: GGUFTensor, raw: torch.Tensor) -> torch.Tensor:
        kind = KINDS[t.type_name]
        flat = raw.reshape(1, -1)
        if kind in ("f32", "f16", "bf16"):
            source = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]
            return flat.view(source).reshape(t.shape).to(self.dtype).contiguous()
        return dequantize(QuantizedMatrix(kind, flat, t.shape[0]), self.dtype).reshape(t.shape)

    def _matrix(self, t: GGUFTensor, raw: torch.Tensor) -> torch.Tensor | QuantizedMatrix:
        kind = KINDS[t.type_name]
        if all(self._plain(s) for s in _fused_with(t.name)):
            return raw.view(self.dtype).reshape(t.shape)
        return QuantizedMatrix(kind, raw, t.shape[-1])

    def _plain(self, gguf_name: str) -> bool:
        """Whether the file's tensor ``gguf_name`` is a float matrix of the activations' dtype (absent: yes)."""
        t = self.file.tensors.get(gguf_name)
        return t is None or (KINDS[t.type_name], self.dtype) in (("f32", torch.float32), ("bf16", torch.bfloat16))

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_FUSED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


def _fused_with(name: str) -> tuple[str, ...]:
    """The GGUF tensors the forward fuses ``name`` with, itself included (q/k/v, gate/up): a float matrix
    fused with blocks is kept as blocks of its type, so the fused matrix is one ``QuantizedMatrix``."""
    head, _, tail = name.rpartition(".")
    head, _, part = head.rpartition(".")
    for group in _FUSED:
        if f"{part}.{tail}" in group:
            return tuple(f"{head}.{g}" for g in group)
    return (name,)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (its converter interleaves each head's two RoPE
    halves: HF row ``h*D + j*D/2 + i`` is GGUF row ``h*D + 2*i + j``), as transformers' GGUF loader does."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def rope_freqs(f: GGUFFile) -> torch.Tensor | None:
    """Llama 3's RoPE frequency factors ([head_dim // 2] float32) when the file has them, else None."""
    t = f.tensors.get(ROPE_FREQS)
    if t is None:
        return None
    if t.type_name != "F32":
        raise ModelLoadError(f"{f.path}: {ROPE_FREQS} is {t.type_name}; llama.cpp writes it as F32")
    return f.read(t.name).view(torch.float32).reshape(-1).clone()


def apply_rope_freqs(model: Any, factors: torch.Tensor | None) -> None:
    """Divide ``model``'s RoPE inverse frequencies by llama.cpp's per-frequency ``factors`` (llama.cpp's
    ``rope_freqs``: ``theta / freq_factor``).  Raises ``ModelLoadError`` for a length that does not match."""
    if factors is None:
        return
    if factors.shape != model.inv_freq.shape:
        raise ModelLoadError(
            f"{ROPE_FREQS} has {factors.numel()} factors; the model's RoPE has {model.inv_freq.numel()} frequencies"
        )
    model.inv_freq = model.inv_freq / factors.to(model.inv_freq.device)


def gguf_weights_bytes(f: GGUFFile) -> int:
    """Bytes of every tensor the model keeps, as the file stores them."""
    return sum(t.nbytes for t in f.tensors.values())


def open_model(path: Path) -> GGUFFile:
    """``path`` opened, checked as a file and as a model this forward runs.  Raises ``ModelLoadError``."""
    f = GGUFFile.open(path)
    check_model(f)
    return f


__all__ = [
    "ARCHITECTURES",
    "EOG_TEXTS",
    "KINDS",
    "PRE_TOKENIZERS",
    "GGUFTensors",
    "apply_rope_freqs",
    "check_model",
    "gguf_config",
    "gguf_eos_ids",
    "gguf_tokenizer",
    "hf_name",
    "open_model",
    "rope_freqs",
    "unpermute_rows",
]
