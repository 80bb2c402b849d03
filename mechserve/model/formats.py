"""The file formats weights are read from: one ``weights.TensorSource`` each, under Hugging Face names.

``SafetensorsFiles``       a checkpoint directory's ``*.safetensors``, each tensor whole (one process)
                           or a span of its rows or columns (a tensor-parallel rank reads only its
                           slices: ``safe_open(...).get_slice``), cast to the model's dtype
``QuantizedSafetensors``   the same files with the weight matrices in GGUF blocks (``--quantization``):
                           a GGUF file's own blocks where it holds the matrix in the wanted format (the
                           embedded SmolLM2's Q4_1 file, ``gguf_matrices``), else ggml's rounding of the
                           float weights (``quantized.quantize``)

``weights.assemble`` turns any of them into a model's parts through the one weight-name map, so a new
format is one more class here with ``path``, ``has`` and ``read`` (see ``model/weights.py`` for how a
GGUF reader plugs in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.quantized import QK, QUANTIZATIONS, QuantizedMatrix, quantize
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


__all__ = ["EMBEDDING_FORMAT", "QuantizedSafetensors", "SafetensorsFiles", "gguf_matrices"]
