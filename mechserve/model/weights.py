"""The weight-name map: which checkpoint tensors make which part of a Llama-shaped model, for every loader.

One table (``MODEL_PARTS``, ``LAYER_PARTS``) names each part of ``ModelWeights`` / ``LayerWeights``,
the tensors it is stacked from (their Hugging Face and GGUF names), what its rows and columns
are, and which ``LlamaArch`` flag switches it on::

    part           from (Hugging Face  /  GGUF, per layer i)                rows x cols     when
    embed          model.embed_tokens.weight  /  token_embd.weight          vocab x hidden
    norm           model.norm.weight  /  output_norm.weight                 hidden
    lm_head        lm_head.weight  /  output.weight                         vocab x hidden  untied (else = embed)
    input_norm     .input_layernorm.weight  /  .attn_norm.weight            hidden
    qkv            .self_attn.{q,k,v}_proj.weight  /  .attn_{q,k,v}.weight  q+kv+kv x hidden
    qkv_bias       .self_attn.{q,k,v}_proj.bias  /  .attn_{q,k,v}.bias      q+kv+kv         qkv_bias
    o              .self_attn.o_proj.weight  /  .attn_output.weight         hidden x q
    o_bias         .self_attn.o_proj.bias  /  .attn_output.bias             hidden          o_bias
    q_norm, k_norm .self_attn.{q,k}_norm.weight  /  .attn_{q,k}_norm.weight head            qk_norm
    post_norm      .post_attention_layernorm.weight  /  .ffn_norm.weight    hidden
    gate_up        .mlp.{gate,up}_proj.weight  /  .ffn_{gate,up}.weight     inter+inter x hidden
    gate_up_bias   .mlp.{gate,up}_proj.bias  /  .ffn_{gate,up}.bias         inter+inter     mlp_bias
    down           .mlp.down_proj.weight  /  .ffn_down.weight               hidden x inter
    down_bias      .mlp.down_proj.bias  /  .ffn_down.bias                   hidden          mlp_bias

(``q`` = heads x head_dim, ``kv`` = KV heads x head_dim, ``head`` = head_dim; GGUF names are
llama.cpp's, as gguf-py's ``TensorNameMap`` gives them.)  A part stacked from several tensors is
fused along its rows in the order listed (one ``qkv`` matrix, one ``gate_up``).

**Tensor parallelism** (Megatron, ``model/sharded.py``) needs no second table: a rank keeps its span
of every ``q``, ``kv``, ``inter`` and ``vocab`` axis, and whole copies of the rest.  So ``qkv`` and
``gate_up`` are split by rows (column-parallel), ``o`` and ``down`` by columns (row-parallel), the
embedding and LM head by vocabulary rows; norms and the ``o``/``down`` biases are replicated.

**Loaders.**  ``assemble(source, arch, split)`` builds a model's parts from any ``TensorSource``:
a file format is one class with ``has(name)`` and ``read(name, rows, cols, role)`` under Hugging
Face names (``model/formats.py``: safetensors whole or by rank slice, safetensors quantized into GGUF
blocks; ``model/checkpoint.Checkpoint``: tensors in memory).  Every part's shape is checked against
the one ``arch`` implies before it is used.  A GGUF file is one more source (``formats.GGUFTensors``):
it finds the GGUF tensor of a Hugging Face name through ``gguf_to_hf`` (the table's second column),
returns its blocks as ``QuantizedMatrix`` for the ``matrix``/``embedding`` roles and floats for the
rest, and puts back the row order of ``rotary`` tensors where llama.cpp's converter permuted them
(``formats.gguf_matrices`` does the same for the embedded file's Q4_1/Q8_0 blocks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Literal, Protocol

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.arch import LlamaArch
from mechserve.model.layer import LayerWeights, Matrix
from mechserve.model.quantized import QuantizedMatrix

# An axis of a part: the model's width, one head, the Q heads, the KV heads, the MLP, the vocabulary.
Dim = Literal["hidden", "head", "q", "kv", "inter", "vocab"]
# The axes a tensor-parallel rank keeps a span of (Megatron); every other axis is whole on every rank.
SPLIT_DIMS: tuple[Dim, ...] = ("q", "kv", "inter", "vocab")
# How a loader keeps a tensor: floats (norms, biases), a weight matrix, or the embedding / LM head
# (a quantized model keeps those two in their own block format, ``formats.EMBEDDING_FORMAT``).
Role = Literal["vector", "matrix", "embedding"]
Span = tuple[int, int]  # [start, end) along one axis


@dataclass(frozen=True, slots=True)
class Piece:
    """One checkpoint tensor of a part: its Hugging Face and GGUF names (``{i}``: the layer) and what its
    rows are.  ``rotary``: rows that RoPE rotates (q and k), which llama.cpp's converter reorders for
    Llama-architecture GGUF files."""

    hf: str
    gguf: str
    rows: Dim
    rotary: bool = False


@dataclass(frozen=True, slots=True)
class Part:
    """One field of ``ModelWeights``/``LayerWeights`` (``name``): its ``pieces`` stacked along the rows,
    its columns (``cols``; None for a vector), the ``LlamaArch`` flag that switches it on (``when``;
    None: every model has it) and how loaders keep it (``role``)."""

    name: str
    pieces: tuple[Piece, ...]
    cols: Dim | None = None
    when: str | None = None
    role: Role = "vector"


def _layer(hf: str, gguf: str, rows: Dim, rotary: bool = False) -> Piece:
    return Piece(f"model.layers.{{i}}.{hf}", f"blk.{{i}}.{gguf}", rows, rotary)


def _qkv(kind: str) -> tuple[Piece, ...]:
    return (
        _layer(f"self_attn.q_proj.{kind}", f"attn_q.{kind}", "q", rotary=True),
        _layer(f"self_attn.k_proj.{kind}", f"attn_k.{kind}", "kv", rotary=True),
        _layer(f"self_attn.v_proj.{kind}", f"attn_v.{kind}", "kv"),
    )


def _gate_up(kind: str) -> tuple[Piece, ...]:
    return _layer(f"mlp.gate_proj.{kind}", f"ffn_gate.{kind}", "inter"), _layer(
        f"mlp.up_proj.{kind}", f"ffn_up.{kind}", "inter"
    )


MODEL_PARTS: tuple[Part, ...] = (
    Part("embed", (Piece("model.embed_tokens.weight", "token_embd.weight", "vocab"),), "hidden", role="embedding"),
    Part("norm", (Piece("model.norm.weight", "output_norm.weight", "hidden"),)),
    Part("lm_head", (Piece("lm_head.weight", "output.weight", "vocab"),), "hidden", role="embedding"),
)
LAYER_PARTS: tuple[Part, ...] = (
    Part("input_norm", (_layer("input_layernorm.weight", "attn_norm.weight", "hidden"),)),
    Part("qkv", _qkv("weight"), "hidden", role="matrix"),
    Part("qkv_bias", _qkv("bias"), when="qkv_bias"),
    Part("o", (_layer("self_attn.o_proj.weight", "attn_output.weight", "hidden"),), "q", role="matrix"),
    Part("o_bias", (_layer("self_attn.o_proj.bias", "attn_output.bias", "hidden"),), when="o_bias"),
    Part("q_norm", (_layer("self_attn.q_norm.weight", "attn_q_norm.weight", "head"),), when="qk_norm"),
    Part("k_norm", (_layer("self_attn.k_norm.weight", "attn_k_norm.weight", "head"),), when="qk_norm"),
    Part("post_norm", (_layer("post_attention_layernorm.weight", "ffn_norm.weight", "hidden"),)),
    Part("gate_up", _gate_up("weight"), "hidden", role="matrix"),
    Part("gate_up_bias", _gate_up("bias"), when="mlp_bias"),
    Part("down", (_layer("mlp.down_proj.weight", "ffn_down.weight", "hidden"),), "inter", role="matrix"),
    Part("down_bias", (_layer("mlp.down_proj.bias", "ffn_down.bias", "hidden"),), when="mlp_bias"),
)


class TensorSource(Protocol):
    """Named tensors of one checkpoint in one file format, under Hugging Face names: what a loader gives
    ``assemble``.

    ``read(name, rows, cols, role)``: the tensor, or its span of rows / columns (``[start, end)``, a
    tensor-parallel rank's slice; None: all), as floats of the model's dtype or (``role`` ``matrix``
    / ``embedding``, in a quantized source) ``QuantizedMatrix`` blocks.  ``path`` is named in errors.
    """

    @property
    def path(self) -> object: ...

    def has(self, name: str) -> bool: ...

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None, role: Role = "vector") -> Matrix: ...


@dataclass(slots=True)
class ModelWeights:
    """A Llama-shaped model's tensors: ``embed`` [V, hidden], final ``norm`` [hidden], ``lm_head``
    [V, hidden] (the same object as ``embed`` when tied) and one ``LayerWeights`` per layer (a
    tensor-parallel rank's: its slices, see the module docstring)."""

    embed: Matrix
    norm: torch.Tensor
    lm_head: Matrix
    layers: list[LayerWeights]


def assemble(source: TensorSource, arch: LlamaArch, split: Mapping[Dim, Span] | None = None) -> ModelWeights:
    """The parts of a model shaped ``arch`` from ``source``, through the weight-name map.

    ``split``: a tensor-parallel rank's ``[start, end)`` of each ``SPLIT_DIMS`` axis it splits, in
    rows or columns (the q and kv spans cover whole heads: multiples of ``head_dim``); None reads
    every tensor whole.  The LM head is the embedding when
    ``arch.tie_word_embeddings`` or the source has no ``lm_head.weight``.  Raises ``ModelLoadError``
    naming a tensor the source lacks or whose shape differs from what ``arch`` (config.json) implies.
    """
    full: dict[Dim, int] = {
        "hidden": arch.hidden_size,
        "head": arch.head_dim,
        "q": arch.num_heads * arch.head_dim,
        "kv": arch.num_kv_heads * arch.head_dim,
        "inter": arch.intermediate_size,
        "vocab": arch.vocab_size,
    }
    spans: Mapping[Dim, Span] = split or {}

    def size(dim: Dim) -> int:
        span = spans.get(dim)
        return full[dim] if span is None else span[1] - span[0]

    def read(part: Part, layer: int | None = None) -> Matrix | None:
        if part.when is not None and not getattr(arch, part.when):
            return None
        pieces: list[Matrix] = []
        for piece in part.pieces:
            name = piece.hf.format(i=layer)
            if not source.has(name):
                raise ModelLoadError(f"checkpoint {source.path} is missing tensor {name!r}")
            cols = None if part.cols is None else spans.get(part.cols)
            tensor = source.read(name, spans.get(piece.rows), cols, part.role)
            want = (size(piece.rows),) if part.cols is None else (size(piece.rows), size(part.cols))
            if tuple(tensor.shape) != want:
                raise ModelLoadError(
                    f"checkpoint {source.path}: {name} has shape {list(tensor.shape)}, "
                    f"but config.json implies {list(want)}"
                )
            pieces.append(tensor)
        return pieces[0] if len(pieces) == 1 else _fuse(pieces)

    embed_part, norm_part, head_part = MODEL_PARTS
    embed, norm = read(embed_part), read(norm_part)
    tied = arch.tie_word_embeddings or not source.has(head_part.pieces[0].hf)
    lm_head = embed if tied else read(head_part)
    layers = [
        LayerWeights(**{part.name: read(part, i) for part in LAYER_PARTS})  # type: ignore[arg-type]
        for i in range(arch.num_layers)
    ]
    # parts without a ``when`` flag are never None
    assert embed is not None and lm_head is not None and isinstance(norm, torch.Tensor)
    return ModelWeights(embed, norm, lm_head, layers)


def _fuse(pieces: list[Matrix]) -> Matrix:
    """Tensors stacked along their rows (q, k, v into one qkv matrix), as floats or as blocks."""
    if all(isinstance(p, QuantizedMatrix) for p in pieces):
        return QuantizedMatrix.cat(pieces)  # type: ignore[arg-type]
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return torch.cat(pieces).contiguous()  # type: ignore[arg-type]
    raise ModelLoadError("cannot stack float tensors with quantized blocks")


def missing_gguf_tensors(source: TensorSource, arch: LlamaArch) -> list[str]:
    """The tensors a model shaped ``arch`` needs that ``source`` (a GGUF file's ``GGUFTensors``) lacks,
    each as ``GGUF name (Hugging Face name)``, so a loader can refuse the file before any slow step
    (building its tokenizer, reading its weights).  The LM head is optional (the embedding when absent)."""
    missing: list[str] = []
    for part in MODEL_PARTS:
        if part.name == "lm_head":
            continue
        missing += [f"{p.gguf} ({p.hf})" for p in part.pieces if not source.has(p.hf)]
    for i in range(arch.num_layers):
        for part in LAYER_PARTS:
            if part.when is not None and not getattr(arch, part.when):
                continue
            for p in part.pieces:
                if not source.has(p.hf.format(i=i)):
                    missing.append(f"{p.gguf.format(i=i)} ({p.hf.format(i=i)})")
    return missing


@cache
def _gguf_patterns() -> tuple[tuple[re.Pattern[str], Part, Piece], ...]:
    found = []
    for part in (*MODEL_PARTS, *LAYER_PARTS):
        for piece in part.pieces:
            pattern = re.escape(piece.gguf).replace(re.escape("{i}"), r"(\d+)")
            found.append((re.compile(pattern), part, piece))
    return tuple(found)


def gguf_to_hf(name: str) -> tuple[str, Part, Piece] | None:
    """The Hugging Face name, part and piece of the GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for a tensor the map does not know."""
    for pattern, part, piece in _gguf_patterns():
        found = pattern.fullmatch(name)
        if found is not None:
            return piece.hf.format(i=int(found.group(1)) if found.groups() else None), part, piece
    return None


__all__ = [
    "LAYER_PARTS",
    "MODEL_PARTS",
    "SPLIT_DIMS",
    "Dim",
    "ModelWeights",
    "Part",
    "Piece",
    "Role",
    "Span",
    "TensorSource",
    "assemble",
    "gguf_to_hf",
    "missing_gguf_tensors",
]
