"""A GGUF file as a mechserve model (``--model path/to/file.gguf``): its config, tokenizer, EOS ids and weights.

The file is opened and checked first (``gguf_file.GGUFFile``: a GGUF, whole), then ``check_model``
refuses, before any weight is read, a file whose

* ``general.architecture`` is not one of ``ARCHITECTURES`` (GGUF's names: ``llama`` -- Llama 1-3,
  Mistral and Mixtral-free Mistral derivatives, SmolLM, TinyLlama, all written as ``llama`` by
  llama.cpp's converter --, ``qwen2``, ``qwen3``),
* tensors include one the weight map does not know (a fused ``attn_qkv``, experts, ...),
* tensors have a type mechserve does not run (``formats.GGUF_KINDS``: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
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
where transformers has none for it (``PRE_TOKENIZERS``), a SentencePiece vocabulary split as llama.cpp
splits it (``spm_like_llama_cpp``) and the BOS/EOS llama.cpp adds (``specials_like_llama_cpp``), so the ids
are llama.cpp's (pinned in tests/data/llama-tokenize-*.json).

**Weights**: ``formats.GGUFTensors``, a ``weights.TensorSource`` over the file, through the one weight-name
map (``weights.gguf_to_hf``); the family is the registry's entry for the architecture's model type
(``family``), which builds the model as from any other format (``ModelFamily.build``).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.formats import GGUF_KINDS
from mechserve.model.gguf_file import GGUFFile
from mechserve.model.registry import ModelFamily, find_family
from mechserve.model.weights import gguf_to_hf

# GGUF architecture -> (Hugging Face model_type, class name): the families the forward runs.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
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
        known = gguf_to_hf(t.name)
        name = known[0] if known is not None else None
        if name is None or (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers):
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} is not part of a {arch} model as mechserve runs it "
                f"(its layers are blk.0..blk.{layers - 1}: attention, norms and a SwiGLU MLP)"
            )
        if t.type_name not in GGUF_KINDS:
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} is {t.type_name}, a type mechserve does not run; "
                f"supported: {', '.join(GGUF_KINDS)}"
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


# The special-token ids of the metadata; llama.cpp's "no token" (-1, or its uint32 form) is allowed.
TOKEN_ID_KEYS = tuple(
    f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "eot", "eom", "padding", "unknown", "sep")
)
NO_TOKEN = (-1, 0xFFFFFFFF)


def _check_token_ids(f: GGUFFile, vocab: Any) -> None:
    """Raise ``ModelLoadError`` unless the vocabulary size is a whole number >= 1 and every special-token id
    of ``TOKEN_ID_KEYS`` present is an id of it (a damaged file's EOS would otherwise never end a request)."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ModelLoadError(f"{f.path}: its vocabulary size must be a whole number >= 1, got {vocab!r}")
    for key in TOKEN_ID_KEYS:
        value = f.get(key)
        if value is None or value in NO_TOKEN:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise ModelLoadError(f"{f.path}: metadata {key} is {value!r}, not an id of its {vocab}-token vocabulary")


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
    _check_token_ids(f, vocab)
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
    specials_like_llama_cpp(tok, f)
    if kind == "llama":
        spm_like_llama_cpp(tok, add_space_prefix=bool(f.get("tokenizer.ggml.add_space_prefix", True)))
        return tok
    splits = PRE_TOKENIZERS.get(f.get("tokenizer.ggml.pre", ""))
    if splits is not None:
        steps: list[Any] = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return tok


# llama.cpp's ``tokenizer.ggml.pre`` values whose BPE vocabulary adds a BOS when the file has no
# ``tokenizer.ggml.add_bos_token`` (llama-vocab.cpp, ``llama_vocab::impl::load``); other BPE ones add none.
BOS_BY_DEFAULT_PRE = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken", "chameleon")
)


def specials_like_llama_cpp(tok: Any, f: GGUFFile) -> None:
    """Make ``tok`` add the BOS and EOS llama.cpp adds: ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token`` when the file has them, else llama.cpp's default for the vocabulary (SentencePiece:
    BOS, no EOS; BPE: BOS only for the pre-tokenizers in ``BOS_BY_DEFAULT_PRE``, e.g. Llama 3's; no EOS).
    The default BOS and EOS ids are llama.cpp's too (SentencePiece 1 and 2, BPE 11).  Raises
    ``ModelLoadError`` when the id to add is outside the vocabulary."""
    from tokenizers import processors

    spm = f.get("tokenizer.ggml.model") == "llama"
    add_bos = f.get("tokenizer.ggml.add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = spm or f.get("tokenizer.ggml.pre", "") in BOS_BY_DEFAULT_PRE
    add_eos = f.get("tokenizer.ggml.add_eos_token")
    add_eos = add_eos if isinstance(add_eos, bool) else False
    tokens = f.get("tokenizer.ggml.tokens") or []
    texts: dict[str, str] = {}
    specials: list[tuple[str, int]] = []
    for flag, key, default in ((add_bos, "bos", 1 if spm else 11), (add_eos, "eos", 2 if spm else 11)):
        if not flag:
            continue
        i = f.get(f"tokenizer.ggml.{key}_token_id", default)
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise ModelLoadError(f"{f.path}: tokenizer.ggml.{key}_token_id {i!r} is not a token of its vocabulary")
        texts[key] = tokens[i]
        if (tokens[i], i) not in specials:
            specials.append((tokens[i], i))
    bos = [f"{texts['bos']}:0"] if "bos" in texts else []
    eos = [f"{texts['eos']}:0"] if "eos" in texts else []
    single = " ".join([*bos, "$A:0", *eos])
    pair = " ".join([single, *(b.replace(":0", ":1") for b in bos), "$B:1", *(e.replace(":0", ":1") for e in eos)])
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def spm_like_llama_cpp(tok: Any, *, add_space_prefix: bool) -> None:
    """Make ``tok`` (transformers' SentencePiece tokenizer of a GGUF) split text as llama.cpp does
    (``llama-vocab.cpp``, ``llama_vocab::impl::tokenize``, ``LLAMA_VOCAB_TYPE_SPM``): the text is cut at
    special tokens; every text piece between them (each one follows a special token or starts the text) gets
    a ``' '`` prefix when ``tokenizer.ggml.add_space_prefix`` (default true), and every space becomes U+2581;
    then the pieces are merged.  transformers' Metaspace ``prepend_scheme="first"`` instead prefixes only the
    text's first piece and not one that already starts with a space, so ``' Hello'``, ``'<s>hi'`` and
    ``'   '`` came out differently.  The tokenizers library runs the normalizer on each piece between added
    tokens, which is llama.cpp's rule."""
    from tokenizers import normalizers

    steps: list[Any] = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    steps.append(normalizers.Replace(" ", "\u2581"))
    tok.backend_tokenizer.normalizer = normalizers.Sequence(steps)
    tok.backend_tokenizer.pre_tokenizer = None


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


def family(f: GGUFFile) -> ModelFamily:
    """The registry's family of ``f``'s architecture (GGUF names it by model type; ``check_model`` first)."""
    model_type, cls_name = ARCHITECTURES[f.architecture]
    return find_family([cls_name], model_type, f.path)


def open_model(path: Path) -> GGUFFile:
    """``path`` opened, checked as a file and as a model this forward runs.  Raises ``ModelLoadError``."""
    f = GGUFFile.open(path)
    check_model(f)
    return f


__all__ = [
    "ARCHITECTURES",
    "BOS_BY_DEFAULT_PRE",
    "EOG_TEXTS",
    "PRE_TOKENIZERS",
    "apply_rope_freqs",
    "check_model",
    "family",
    "gguf_config",
    "gguf_eos_ids",
    "gguf_tokenizer",
    "open_model",
    "rope_freqs",
    "specials_like_llama_cpp",
    "spm_like_llama_cpp",
]
