"""The file formats weights are read from: one ``weights.TensorSource`` each, under Hugging Face names.

``SafetensorsFiles``       a checkpoint directory's ``*.safetensors``, each tensor whole (one process)
                           or a span of its rows or columns (a tensor-parallel rank reads only its
                           slices: ``safe_open(...).get_slice``), cast to the model's dtype
``QuantizedSafetensors``   the same files with the weight matrices in GGUF blocks (``--quantization``):
                           a GGUF file's own blocks where it holds the matrix in the wanted format (the
                           embedded SmolLM2's Q4_1 file, ``gguf_matrices``), else ggml's rounding of the
                           float weights (``quantized.quantize``)

``GGUFTensors``             a GGUF file's tensors (``--model FILE.gguf``, issue 30): each read from the
                           file when asked for, its matrices kept in the blocks the file stores
                           (``QuantizedMatrix`` of their kind), the rows of q and k put back in
                           Hugging Face's order for a ``llama`` file; the file is checked and its config
                           and tokenizer read by ``model/gguf_model.py``

``weights.assemble`` turns any of them into a model's parts through the one weight-name map, so a new
format is one more class here with ``path``, ``has`` and ``read``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.gguf_file import GGUFFile, GGUFTensor
from mechserve.model.quantized import QK, QUANTIZATIONS, QuantizedMatrix, dequantize, quantize
from mechserve.model.weights import Role, Span, gguf_to_hf

# The embedding (and a tied or separate LM head) stays Q8_0 whatever the layers' format, as in the
# embedded SmolLM2 file (llama.cpp's own choice for the output matrix).
EMBEDDING_FORMAT = "q8_0"


class SafetensorsFiles:
    """Every ``*.safetensors`` file of the directory ``path`` as one ``TensorSource``; ``read`` casts to
    ``dtype``, ``tensor`` gives a tensor as stored.  A context manager: leaving it closes the files
    (tensors already read stay valid).  Raises ``ModelLoadError`` for a directory without weights or a
    file safetensors cannot read."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        from safetensors import SafetensorError, safe_open

        self.path, self.dtype = path, dtype
        self._errors: tuple[type[Exception], ...] = (OSError, SafetensorError)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors weights in {path}")
        self._handles: list[Any] = []
        self._where: dict[str, tuple[Path, Any]] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except self._errors as e:
                self.close()
                raise ModelLoadError(f"cannot read weights {f}: {e}") from None
            self._handles.append(handle)
            self._where.update((name, (f, handle)) for name in names)  # a later file's copy wins, as in a dict update

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every file."""
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles = []

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str, rows: Span | None, cols: Span | None) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"checkpoint {self.path} is missing tensor {name!r}")
        f, handle = self._where[name]
        try:
            if rows is None and cols is None:
                return handle.get_tensor(name)
            whole = handle.get_slice(name)
            r = slice(None) if rows is None else slice(*rows)
            return whole[r] if cols is None else whole[r, slice(*cols)]
        except self._errors as e:
            raise ModelLoadError(f"cannot read weights {f}: {e}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` whole, in the dtype it is stored in."""
        return self._slice(name, None, None)

    def read(
        self, name: str, rows: Span | None = None, cols: Span | None = None, role: Role = "vector"
    ) -> torch.Tensor:
        """Rows ``[rows)`` and columns ``[cols)`` of ``name`` (None: all), contiguous, in ``dtype``."""
        return self._slice(name, rows, cols).to(self.dtype).contiguous()


class QuantizedSafetensors:
    """``files`` with every weight matrix in blocks of ``kind`` (``"q4_1"``/``"q8_0"``), the embedding and
    LM head in ``EMBEDDING_FORMAT``, everything else (norms, biases) floats of ``files.dtype``.

    ``stored``: blocks under Hugging Face names (``gguf_matrices`` of a GGUF file of the same model),
    taken as they are for a matrix they hold in the wanted format; the rest is quantized from the
    float weights as stored (ggml's rounding).  Raises ``ValueError`` for an unknown ``kind``;
    ``read`` raises ``ModelLoadError`` for a matrix whose rows are not a multiple of 32 wide, and
    ``ValueError`` for a span (a quantized model runs on one rank).
    """

    def __init__(self, files: SafetensorsFiles, kind: str, stored: Mapping[str, QuantizedMatrix] | None = None) -> None:
        if kind not in QUANTIZATIONS:
            raise ValueError(f"unknown block format {kind!r}; known: {', '.join(QUANTIZATIONS)}")
        self.files, self.kind, self.stored = files, kind, stored or {}

    @property
    def path(self) -> Path:
        return self.files.path

    def __enter__(self) -> QuantizedSafetensors:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.files.close()

    def has(self, name: str) -> bool:
        return self.files.has(name)

    def read(
        self, name: str, rows: Span | None = None, cols: Span | None = None, role: Role = "vector"
    ) -> torch.Tensor | QuantizedMatrix:
        if rows is not None or cols is not None:
            raise ValueError("a quantized model is read whole (it runs on one rank)")
        if role == "vector":
            return self.files.read(name)
        want = EMBEDDING_FORMAT if role == "embedding" else self.kind
        found = self.stored.get(name)
        if found is not None and found.kind == want:
            return found
        weight = self.files.tensor(name)
        if weight.dim() != 2:
            raise ModelLoadError(
                f"checkpoint {self.path}: {name} has shape {list(weight.shape)}, not a matrix's two axes"
            )
        if weight.shape[1] % QK:
            raise ModelLoadError(f"{name} has rows of {weight.shape[1]} weights; {want} needs a multiple of {QK}")
        return quantize(weight, want)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (its converter interleaves each head's two RoPE
    halves: HF row ``h*D + j*D/2 + i`` is GGUF row ``h*D + 2*i + j``), as transformers' GGUF loader does."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def gguf_matrices(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantizedMatrix]:
    """The Q4_1/Q8_0 matrices of a Llama-architecture GGUF as they are stored, under Hugging Face tensor
    names (the weight-name map, ``weights.gguf_to_hf``), the rows of q and k put back in Hugging Face's
    order.  Tensors of other types, and vectors, are left out (the caller takes those from the float
    checkpoint).  Raises ``ModelLoadError`` if the file cannot be read.
    """
    try:
        from gguf import GGMLQuantizationType, GGUFReader

        reader = GGUFReader(str(path))
    except (ImportError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {exc}") from None
    kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    out: dict[str, QuantizedMatrix] = {}
    for t in reader.tensors:
        kind = kinds.get(t.tensor_type)
        known = gguf_to_hf(t.name)
        if kind is None or known is None or known[1].cols is None:
            continue
        name, _part, piece = known
        k = int(t.shape[0])  # GGUF lists the fastest-varying axis first
        blocks = torch.from_numpy(t.data.copy()).reshape(int(t.shape[1]), -1)
        if piece.rotary:
            blocks = blocks[_unpermute_rows(blocks.shape[0], num_heads if piece.rows == "q" else num_kv_heads)]
        out[name] = QuantizedMatrix(kind, blocks.contiguous(), k)
    return out


# ggml type name -> the kind a GGUF file's matrix of that type is kept as (every type mechserve runs).
GGUF_KINDS = {
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
# The GGUF tensors the forward fuses (q/k/v, gate/up): a float matrix among blocks is kept as blocks of its
# type, so that the fused matrix is one QuantizedMatrix (a mixed one where the formats differ).
_FUSED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


class GGUFTensors:
    """The tensors of a checked GGUF file (``gguf_model.open_model``) as a ``weights.TensorSource`` under
    Hugging Face names (``weights.gguf_to_hf``), read from the file when asked for (nothing is cached, so
    loading holds one layer's parts beside the model, never a second copy of it).

    Matrices (roles ``matrix``, ``embedding``) as the file stores them: a ``QuantizedMatrix`` of their
    kind (``GGUF_KINDS``), or a plain tensor when their type is the activations' ``dtype`` (F32 with
    float32, BF16 with bfloat16) and so are the matrices fused with them.  Vectors (norms, biases) as
    floats of ``dtype``.  A ``llama`` file's q and k rows are put back in Hugging Face's order
    (``Piece.rotary``).  One process only: a span of rows or columns is a ``ValueError``; a failed read
    a ``ModelLoadError``.
    """

    def __init__(self, f: GGUFFile, config: Any, dtype: torch.dtype) -> None:
        self.file, self.config, self.dtype = f, config, dtype
        self._names: dict[str, tuple[GGUFTensor, Any]] = {}
        for t in f.tensors.values():
            known = gguf_to_hf(t.name)
            if known is not None:
                self._names[known[0]] = (t, known[2])
        self._permute = f.architecture == "llama"  # llama.cpp's converter permuted q/k for its NORM RoPE

    @property
    def path(self) -> Path:
        return self.file.path

    def has(self, name: str) -> bool:
        return name in self._names

    def read(
        self, name: str, rows: Span | None = None, cols: Span | None = None, role: Role = "vector"
    ) -> torch.Tensor | QuantizedMatrix:
        if rows is not None or cols is not None:
            raise ValueError("a GGUF model is read whole (it runs in one process)")
        t, piece = self._names[name]
        raw = self.file.read(t.name)
        kind = GGUF_KINDS[t.type_name]
        if len(t.shape) == 1:
            flat = raw.reshape(1, -1)
            if kind in ("f32", "f16", "bf16"):
                source = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]
                return flat.view(source).reshape(t.shape).to(self.dtype).contiguous()
            return dequantize(QuantizedMatrix(kind, flat, t.shape[0]), self.dtype).reshape(t.shape)
        value: torch.Tensor | QuantizedMatrix
        if all(self._plain(n) for n in _fused_with(t.name)):
            value = raw.view(self.dtype).reshape(t.shape)
        else:
            value = QuantizedMatrix(kind, raw, t.shape[-1])
        if self._permute and piece.rotary:
            heads = self.config.num_attention_heads if piece.rows == "q" else self.config.num_key_value_heads
            order = _unpermute_rows(t.shape[0], heads)
            if isinstance(value, QuantizedMatrix):
                value = QuantizedMatrix(value.kind, value.blocks.index_select(0, order), value.in_features)
            else:
                value = value.index_select(0, order)
        return value

    def _plain(self, gguf_name: str) -> bool:
        """Whether the file's tensor ``gguf_name`` is a float matrix of the activations' dtype (absent: yes)."""
        t = self.file.tensors.get(gguf_name)
        return t is None or (GGUF_KINDS[t.type_name], self.dtype) in (("f32", torch.float32), ("bf16", torch.bfloat16))


def _fused_with(name: str) -> tuple[str, ...]:
    """The GGUF tensors the forward fuses ``name`` with, itself included (``_FUSED``)."""
    head, _, tail = name.rpartition(".")
    head, _, part = head.rpartition(".")
    for group in _FUSED:
        if f"{part}.{tail}" in group:
            return tuple(f"{head}.{g}" for g in group)
    return (name,)


__all__ = [
    "EMBEDDING_FORMAT",
    "GGUF_KINDS",
    "GGUFTensors",
    "QuantizedSafetensors",
    "SafetensorsFiles",
    "gguf_matrices",
]
