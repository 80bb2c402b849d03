"""A GGUF file read and checked before any weight is: its metadata, its tensor table, and its tensors' bytes.

``GGUFFile.open(path)`` parses the header (GGUF versions 2 and 3, little-endian: magic, version,
counts, the metadata key/value pairs, one entry per tensor) and checks, before anything else is
read or computed, that

* the file is a GGUF file and its header is whole (``not a GGUF file`` / ``truncated``),
* every tensor's type is a ggml type this gguf package knows (``unknown tensor type``),
* every tensor's bytes lie inside the file (``truncated: tensor X needs bytes [a, b) but the file
  has n``), with the data section aligned as ``general.alignment`` says (default 32).

Each failure is one ``ModelLoadError`` naming the file and what is wrong.  Whether the model is one
mechserve runs (its architecture, the types of its tensors, their names) is ``gguf_model``'s check,
on this table, before any weight is read.  ``read`` returns one tensor's bytes read from the file into
memory of its own (no memory map), so a loaded model holds each weight once.

The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (gguf-py's ``GGUFReader`` reads
the same layout; its errors on a damaged file are a reshape failure or an enum's ``ValueError``, so
the header is walked here to say which tensor is damaged).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from mechserve.api.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Upper bounds that keep a damaged count from allocating the machine away before the check fails.
MAX_ITEMS = 1 << 24
MAX_STRING = 1 << 26

# GGUF's value types: struct format of each scalar type (gguf.GGUFValueType's numbers).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the table: ``shape`` in torch's order (rows first; GGUF lists the fastest axis
    first), its ggml type number and name (``type_name``), where its bytes start in the file and how many."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of the tensor as a matrix (1 for a vector)."""
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1


class _Header:
    """A cursor over the header bytes of an open file, raising ``EOFError`` where the file ends."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError
        return data

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        if n > MAX_STRING:
            raise ValueError(f"a string of {n} bytes")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.scalar(4), self.scalar(10)
            if count > MAX_ITEMS:
                raise ValueError(f"an array of {count} items")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                return np.frombuffer(self.take(dtype.itemsize * count), dtype=dtype).tolist()
            if item in (_STRING, _ARRAY):
                return [self.value(item) for _ in range(count)]
            raise ValueError(f"an array of unknown value type {item}")
        if vtype in _SCALARS:
            return self.scalar(vtype)
        raise ValueError(f"unknown value type {vtype}")


@dataclass(slots=True)
class GGUFFile:
    """A parsed and checked GGUF file: ``metadata`` (key -> value: numbers, strings, lists) and ``tensors``
    (name -> ``GGUFTensor``, in file order)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    size: int

    @classmethod
    def open(cls, path: Path | str) -> GGUFFile:
        """Parse ``path``'s header and tensor table and check them (module docstring).

        Raises ``ModelLoadError`` naming the file and the problem.
        """
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb", buffering=1 << 20) as f:
                return cls._parse(path, f, size)
        except EOFError:
            raise ModelLoadError(f"{path} is truncated: its GGUF header ends early ({size} bytes)") from None
        except OSError as exc:
            raise ModelLoadError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ModelLoadError(f"{path} is not a valid GGUF file: {exc}") from None

    @classmethod
    def _parse(cls, path: Path, f: BinaryIO, size: int) -> GGUFFile:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        h = _Header(f)
        if size < 4 or h.take(4) != MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the magic bytes 'GGUF')")
        version = h.scalar(4)
        if version not in VERSIONS:
            raise ModelLoadError(f"{path} is GGUF version {version}; mechserve reads versions 2 and 3")
        n_tensors, n_kv = h.scalar(10), h.scalar(10)
        if n_tensors > MAX_ITEMS or n_kv > MAX_ITEMS:
            raise ValueError(f"its header counts {n_tensors} tensors and {n_kv} metadata keys")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string()
            metadata[key] = h.value(h.scalar(4))
        entries = []
        for _ in range(n_tensors):
            name = h.string()
            n_dims = h.scalar(4)
            if not 1 <= n_dims <= 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = [h.scalar(10) for _ in range(n_dims)]
            entries.append((name, dims, h.scalar(4), h.scalar(10)))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-f.tell() // alignment) * alignment  # the data section
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, rel in entries:
            try:
                qtype = GGMLQuantizationType(type_id)
                block, block_bytes = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has tensor type {type_id}, which is not a ggml type "
                    "(a newer llama.cpp's, or a damaged file)"
                ) from None
            count = int(np.prod(dims))
            if dims[0] % block:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} ({qtype.name}) has rows of {dims[0]} values, not whole blocks of {block}"
                )
            nbytes = count // block * block_bytes
            offset = start + rel
            if name in tensors:
                raise ValueError(f"tensor {name!r} is listed twice")
            if offset + nbytes > size:
                raise ModelLoadError(
                    f"{path} is truncated: tensor {name!r} needs bytes [{offset}, {offset + nbytes}) "
                    f"but the file has {size}"
                )
            shape = tuple(int(d) for d in reversed(dims))
            tensors[name] = GGUFTensor(name, shape, int(type_id), qtype.name, offset, nbytes)
        return cls(path, int(version), metadata, tensors, size)

    @property
    def architecture(self) -> str:
        """``general.architecture`` ("" when the file has none)."""
        value = self.metadata.get("general.architecture", "")
        return value if isinstance(value, str) else ""

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (``{arch}`` in it replaced by the architecture), or ``default``."""
        return self.metadata.get(key.replace("{arch}", self.architecture), default)

    def read(self, name: str) -> torch.Tensor:
        """The bytes of tensor ``name`` as a uint8 tensor ``[rows, bytes per row]`` read into memory of its own.

        Raises ``ModelLoadError`` if the file cannot be read (or shrank since it was opened).
        """
        t = self.tensors[name]
        out = torch.empty(t.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        try:
            with open(self.path, "rb", buffering=0) as f:
                got = 0
                while got < t.nbytes:
                    n = os.preadv(f.fileno(), [view[got:]], t.offset + got)
                    if n <= 0:
                        raise ModelLoadError(f"{self.path} is truncated: tensor {name!r} ends at byte {t.offset + got}")
                    got += n
        except OSError as exc:
            raise ModelLoadError(f"cannot read tensor {name!r} of {self.path}: {exc.strerror or exc}") from None
        return out.view(t.rows, -1)


def is_gguf(path: Path | str) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes (its name need not end in .gguf)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


__all__ = ["GGUFFile", "GGUFTensor", "is_gguf"]
