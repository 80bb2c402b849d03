"""An EAGLE draft head: one decoder layer fed the target's final hidden states, its files and how it is found.

EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", arXiv
2401.15077) drafts at the feature level: the head reads the target's feature ``f_p`` (the final hidden
state of position ``p``, after the last norm) and the embedding of the token that followed it, and predicts
the next feature, whose LM-head argmax is the guess::

    row p:  x = fc([embed(t_{p+1}); f_p])              fc: [2 * hidden] -> [hidden], with a bias (EAGLE-1)
            h = decoder_layer(x | rows before p)       one Llama layer of the target's shape (its heads,
                                                       KV heads, head dim, MLP width), RoPE at position p
            f^_{p+1} = norm(h)                         the target's final norm, frozen and shared
            guess t_{p+2} = argmax lm_head(f^_{p+1})   the target's LM head, frozen and shared

Chain drafting (EAGLE-1's chain, not its tree): guess ``r + 1`` feeds row ``(f^, guess r)`` back, the head's
own predicted feature in place of the target's.  Where this differs from EAGLE-1: the predicted feature goes
through the target's final norm before the LM head (EAGLE-1 regresses the post-norm feature directly); the
layer keeps its input norm (EAGLE-1 drops it in its first layer); and the head attends over a window of at
most ``window`` real rows (the ones the target computed while decoding) plus its own chain, recomputed every
step.  Recomputing is exact and cheap: a single layer's K and V of a row depend only on that row's input,
so the window's K/V are the same whenever they are computed, and only the last row runs the MLP.

Files (``save`` / ``load``): a directory holding ``head.safetensors`` (the layer, ``fc`` and
``draft_vocab``: every id, most frequent in the training outputs first) and ``config.json`` (``HeadConfig``
plus how it was trained).  ``mechserve train-draft`` writes it to ``head_dir(target)``:
``$MECHSERVE_CACHE/eagle/<fingerprint>``, where the fingerprint is ``model_fingerprint``: a SHA-256 of the
target's shape and of the weights the head shares or depends on (embedding, LM head, every norm), each
rounded to bfloat16 so that one head serves the exact, fast and quantized modes of one checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mechserve.api.errors import HeadError, ModelLoadError
from mechserve.model.checkpoint import EMBEDDED, embedded_dir
from mechserve.model.linear import dequantize_rows, linear
from mechserve.model.quantized import QuantizedMatrix

HEAD_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_WINDOW = 8


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """The head's shape: the target's ``hidden`` size, query ``heads``, ``kv_heads``, ``head_dim``, MLP
    ``intermediate`` width, ``vocab`` size and ``rms_norm_eps``; ``window``: the most real rows it attends."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_norm_eps: float
    window: int = DEFAULT_WINDOW

    @classmethod
    def of(cls, target: Any, window: int = DEFAULT_WINDOW) -> HeadConfig:
        """The shape of a head for ``target`` (a Llama-family ``Model``)."""
        a = target.arch
        return cls(
            a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.vocab_size,
            float(a.rms_norm_eps), window,
        )  # fmt: skip

    def shape_of(self) -> dict[str, int]:
        """The fields that must equal the target's (all but ``window``)."""
        d = asdict(self)
        d.pop("window")
        d.pop("rms_norm_eps")
        return d


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Shared:
    """The target's frozen parts the head uses, as float32: ``embed(ids)``, ``norm`` ([hidden]), ``logits(f)``
    over the whole vocabulary or a subset ``vocab_ids`` (FR-Spec), and RoPE (``rope(positions)``)."""

    def __init__(self, target: Any, vocab_ids: torch.Tensor | None = None) -> None:
        self.target = target
        self.norm = target.norm.float()
        self.inv_freq = target.inv_freq.float()
        self.rope_scaling = float(getattr(target, "rope_scaling", 1.0))
        self.vocab_ids = vocab_ids
        self.sub_head: torch.Tensor | None = None
        if vocab_ids is not None:
            self.sub_head = _rows(target.lm_head, vocab_ids)  # [N, hidden] float32

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [...] int64 -> [..., hidden] float32."""
        flat = ids.reshape(-1)
        return _rows(self.target.embed, flat).reshape(*ids.shape, -1)

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """``f`` [R, hidden] float32 -> [R, V'] float32 (V' = the subset's size, or the vocabulary's)."""
        if self.sub_head is not None:
            return F.linear(f, self.sub_head)
        head = self.target.lm_head
        if isinstance(head, torch.Tensor) and f.requires_grad:
            return F.linear(f.to(head.dtype), head).float()  # training: autograd through the frozen head
        return linear(f.to(self.target.dtype).contiguous(), head, out_dtype=torch.float32)

    def ids(self, choice: torch.Tensor) -> torch.Tensor:
        """Row indices of ``logits`` -> token ids."""
        return choice if self.vocab_ids is None else self.vocab_ids[choice]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [B, T] int64 -> cos, sin [B, T, 1, head_dim] float32."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling)[..., None, :], (emb.sin() * self.rope_scaling)[..., None, :]


def _rows(matrix: Any, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(matrix, QuantizedMatrix):
        return dequantize_rows(matrix, ids, torch.float32)
    return matrix.index_select(0, ids).float()


class EagleHead(nn.Module):
    """The head's own weights (float32) and its forward, for training (``forward``) and drafting (``draft``).

    ``fc``: [hidden, 2 * hidden] + bias; ``input_norm``, ``post_norm``: [hidden]; ``qkv``: [(H + 2 KV) * D,
    hidden]; ``o``: [hidden, H * D]; ``gate_up``: [2 * I, hidden]; ``down``: [hidden, I].
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(2 * c.hidden, c.hidden)
        self.input_norm = nn.Parameter(torch.ones(c.hidden))
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.gate_up = nn.Linear(c.hidden, 2 * c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices and a zero ``fc`` bias (transformers' Llama init), from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in (self.fc, self.qkv, self.o, self.gate_up, self.down):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
            self.fc.bias.zero_()

    # The layer in pieces: the rows' inputs, their q/k/v, attention, the rest of the layer.

    def inputs(self, shared: Shared, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``ids`` [B, T] int64 (t_{p+1}), ``feats`` [B, T, hidden] float32 (f_p) -> x [B, T, hidden]."""
        return self.fc(torch.cat((shared.embed(ids), feats), dim=-1))

    def qkv_of(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> rotated q [B, T, H, D], k and v [B, T, KV, D]."""
        c = self.config
        b, t, _ = x.shape
        qkv = self.qkv(_rms(x, self.input_norm, c.rms_norm_eps))
        q, k, v = torch.split(qkv, [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = _rotate(q.view(b, t, c.heads, c.head_dim), cos, sin)
        k = _rotate(k.view(b, t, c.kv_heads, c.head_dim), cos, sin)
        return q, k, v.view(b, t, c.kv_heads, c.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Tq, H, D], k/v [B, S, KV, D], ``mask`` [B, Tq, S] bool (True: attend) -> [B, Tq, H * D]."""
        c = self.config
        group = c.heads // c.kv_heads
        kh = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, H, S, D]
        vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], c.heads * c.head_dim)

    def rest(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x [B, T, hidden] + o(attn), then the SwiGLU MLP's residual."""
        x = x + self.o(attn)
        gate, up = self.gate_up(_rms(x, self.post_norm, self.config.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, shared: Shared, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Training: every row of [B, T] causal windows -> the predicted features f^ [B, T, hidden] (normed)."""
        x = self.inputs(shared, ids, feats)
        cos, sin = shared.rope(positions)
        q, k, v = self.qkv_of(x, cos, sin)
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril().expand(ids.shape[0], t, t)
        h = self.rest(x, self.attend(q, k, v, causal))
        return _rms(h, shared.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def draft(
        self,
        shared: Shared,
        ids: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        steps: int,
    ) -> torch.Tensor:
        """Chain drafting: ``steps`` guesses per window, [B, steps] int64.

        ``ids`` [B, S] int64, ``feats`` [B, S, hidden] float32, ``positions`` [B, S] int64 and ``valid``
        [B, S] bool are each window's real rows, left-padded (``valid`` False on padding); its last row
        is the row of the window's last known id's predecessor.  Guess 1 comes from that last row; guess
        ``r + 1`` from the row ``(f^_r, guess r)`` one position on, attending to every valid row before.
        """
        b = ids.shape[0]
        cos, sin = shared.rope(positions)
        x_all = self.inputs(shared, ids, feats)
        q, k, v = self.qkv_of(x_all, cos, sin)
        q, x = q[:, -1:], x_all[:, -1:]
        keys = valid.clone()
        keys[:, -1] = True
        pos = positions[:, -1:]
        out = []
        for r in range(steps):
            h = self.rest(x, self.attend(q, k, v, keys[:, None, :]))
            f = _rms(h, shared.norm, self.config.rms_norm_eps)  # [B, 1, hidden]
            guess = shared.ids(shared.logits(f[:, 0]).argmax(dim=-1))  # [B]
            out.append(guess)
            if r == steps - 1:
                break
            pos = pos + 1
            x = self.inputs(shared, guess[:, None], f)
            cos, sin = shared.rope(pos)
            q, kn, vn = self.qkv_of(x, cos, sin)
            k, v = torch.cat((k, kn), 1), torch.cat((v, vn), 1)
            keys = torch.cat((keys, torch.ones(b, 1, dtype=torch.bool)), 1)
        return torch.stack(out, dim=1)


# Fingerprints, files and the cache ------------------------------------------------------------------------------


def model_fingerprint(target: Any) -> str:
    """A SHA-256 (hex) of ``target``'s shape and of its embedding, LM head (when untied), final norm and every
    layer's norms, each as bfloat16: the same for the exact (float32), fast (bfloat16) and quantized modes
    of one checkpoint, different for another model."""
    a = target.arch
    h = hashlib.sha256()
    shape = [a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.vocab_size]
    h.update(json.dumps(shape).encode())

    def add(t: Any) -> None:
        if isinstance(t, QuantizedMatrix):
            t = dequantize_rows(t, torch.arange(t.shape[0], dtype=torch.int64), torch.float32)
        h.update(t.detach().float().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())

    add(target.embed)
    if target.lm_head is not target.embed:
        add(target.lm_head)
    add(target.norm)
    for w in target.layers:
        add(w.input_norm)
        add(w.post_norm)
    return h.hexdigest()


def model_name(target: Any) -> str:
    """Where ``target`` was loaded from (its config's ``_name_or_path``), for messages."""
    return str(getattr(getattr(target, "config", None), "_name_or_path", "") or "<in memory>")


def head_dir(fingerprint: str) -> Path:
    """``$MECHSERVE_CACHE/eagle/<first 16 hex of fingerprint>``: where ``train-draft`` writes the head."""
    from mechserve.api.env import cache_dir

    return cache_dir() / "eagle" / fingerprint[:16]


def save(
    directory: Path, head: EagleHead, draft_vocab: torch.Tensor, target: Any, fingerprint: str, info: dict[str, Any]
) -> None:
    """Write ``head`` (``HEAD_FILE``: its weights and ``draft_vocab`` [V] int64) and ``CONFIG_FILE`` (its shape,
    the target's fingerprint and name, and ``info``: seed, prompt-set hash, steps, losses, acceptance) into
    ``directory``, through a temporary file each (a reader never sees half a head)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().contiguous() for name, p in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    tmp = directory / f".{HEAD_FILE}.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(directory / HEAD_FILE)
    config = {
        "shape": asdict(head.config),
        "target_fingerprint": fingerprint,
        "target": model_name(target),
        **info,
    }
    tmp = directory / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    tmp.replace(directory / CONFIG_FILE)


@dataclass(frozen=True, slots=True)
class LoadedHead:
    """A head read from ``directory``: its weights, ``draft_vocab`` [V] int64 and its ``config.json``."""

    directory: Path
    head: EagleHead
    draft_vocab: torch.Tensor
    config: dict[str, Any]


def train_command(target: Any, directory: Path | None = None) -> str:
    """The ``mechserve train-draft`` command that writes a head for ``target`` (into ``directory``, else the cache):
    ``--model smollm2`` for the embedded model, else the directory it was loaded from (``MODEL`` if unknown)."""
    name = model_name(target)
    try:
        embedded = name == str(embedded_dir())
    except ModelLoadError:  # no cache directory can be named: then the model is not the embedded one
        embedded = False
    shown = EMBEDDED if embedded else "MODEL" if name == "<in memory>" else shlex.quote(name)
    words = ["mechserve", "train-draft", "--model", shown]
    if directory is not None:
        words += ["--output", shlex.quote(str(directory))]
    return " ".join(words)


def _fix(target: Any, directory: Path, cached: bool) -> str:
    """What to do about a head in ``directory`` that cannot be used: write it (again) with ``train-draft``."""
    if cached:
        return f"run `{train_command(target)}` to write it again"
    return f"write one there with `{train_command(target, directory)}`, or name another with --eagle-head DIR"


def _read_config(directory: Path, fix: str) -> tuple[dict[str, Any], HeadConfig, str]:
    """``directory``'s ``CONFIG_FILE``: the whole object, its checked ``shape`` and the fingerprint of the model
    it was trained for.  Raises ``HeadError`` (ending with ``fix``) for a directory or file that is missing,
    unreadable, not JSON, or without a valid shape and fingerprint."""
    if not directory.exists():
        raise HeadError(f"no EAGLE head at {directory}: no such directory; {fix}")
    if not directory.is_dir():
        raise HeadError(f"no EAGLE head at {directory}: it is a file, not a head's directory; {fix}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        holds = (
            f"it holds {HEAD_FILE} but no {CONFIG_FILE}"
            if (directory / HEAD_FILE).exists()
            else f"it holds neither {CONFIG_FILE} nor {HEAD_FILE}"
        )
        raise HeadError(f"no EAGLE head in {directory}: {holds}; {fix}")
    unreadable = f"the EAGLE head in {directory} is unreadable: {CONFIG_FILE}"
    try:
        config = json.loads(path.read_bytes())
    except OSError as exc:
        raise HeadError(f"{unreadable}: {exc.strerror or exc}; {fix}") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise HeadError(f"{unreadable} is not JSON ({exc}); {fix}") from None
    if not isinstance(config, dict):
        raise HeadError(f"{unreadable} is not a JSON object; {fix}")
    shape, trained_for = config.get("shape"), config.get("target_fingerprint")
    fields = {f.name for f in dataclasses.fields(HeadConfig)}
    if not isinstance(shape, dict) or set(shape) - fields or not fields - {"window"} <= set(shape):
        raise HeadError(f'{unreadable} has no "shape" with the fields {", ".join(sorted(fields))}; {fix}')
    for key, value in shape.items():
        if key == "rms_norm_eps":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not ok:
            what = "a number > 0" if key == "rms_norm_eps" else "an integer >= 1"
            raise HeadError(f"{unreadable}: shape.{key} must be {what}, got {value!r}; {fix}")
    if not isinstance(trained_for, str) or not trained_for:
        raise HeadError(f'{unreadable} has no "target_fingerprint" (the model it was trained for); {fix}')
    return config, HeadConfig(**shape), trained_for


def _read_tensors(directory: Path, shape: HeadConfig, fix: str) -> tuple[EagleHead, torch.Tensor]:
    """The head's weights and draft vocabulary from ``directory``'s ``HEAD_FILE``; ``HeadError`` (ending with
    ``fix``) for a file that is missing, truncated, not safetensors, or whose tensors do not fit ``shape``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / HEAD_FILE
    if not path.is_file():
        raise HeadError(f"no EAGLE head in {directory}: it holds {CONFIG_FILE} but no {HEAD_FILE}; {fix}")
    unreadable = f"the EAGLE head in {directory} is unreadable: {HEAD_FILE}"
    try:
        tensors = load_file(str(path))
    except OSError as exc:
        raise HeadError(f"{unreadable}: {exc.strerror or exc}; {fix}") from None
    except (SafetensorError, ValueError, RuntimeError) as exc:
        problem = " ".join(str(exc).split()) or type(exc).__name__
        raise HeadError(f"{unreadable} is truncated or not a safetensors file ({problem}); {fix}") from None
    draft_vocab = tensors.pop("draft_vocab", None)
    head = EagleHead(shape)
    try:
        head.load_state_dict(tensors)
    except RuntimeError as exc:
        problem = " ".join(str(exc).split("\n", 1)[-1].split()) or "its tensors"
        raise HeadError(f"the EAGLE head in {directory} does not fit its {CONFIG_FILE} ({problem}); {fix}") from None
    if (
        draft_vocab is None
        or draft_vocab.dtype != torch.int64
        or draft_vocab.shape != (shape.vocab,)
        or not torch.equal(draft_vocab.sort().values, torch.arange(shape.vocab))
    ):
        raise HeadError(
            f"{unreadable}: its draft_vocab is not a ranking of the {shape.vocab} ids (int64, each id once); {fix}"
        )
    return head, draft_vocab


def load(directory: Path, target: Any, fingerprint: str | None = None, *, cached: bool = False) -> LoadedHead:
    """The head in ``directory`` checked against ``target`` (``cached``: ``directory`` is ``head_dir``'s, where
    ``train-draft`` writes by default, which only changes the fix the messages give).

    Raises ``HeadError``, one line naming ``directory`` and the ``train-draft`` command that mends it, when
    the directory or either file is missing, a file is unreadable, truncated or not what it should be
    (``config.json`` not JSON, a shape field of the wrong type, tensors that do not fit the shape, a draft
    vocabulary that is not a ranking of every id), and naming both models when the head was trained for
    another model (``fingerprint``, default ``model_fingerprint(target)``) or has another shape.
    """
    directory = Path(directory)
    fix = _fix(target, directory, cached)
    config, shape, trained_for = _read_config(directory, fix)
    fingerprint = fingerprint or model_fingerprint(target)
    want = HeadConfig.of(target, shape.window)
    name = model_name(target)
    trained = config.get("target", "?")
    retrain = f"train one for it with `{train_command(target)}`" + ("" if cached else " and name it with --eagle-head")
    if shape.shape_of() != want.shape_of():
        mine, theirs = shape.shape_of(), want.shape_of()
        differ = ", ".join(f"{k} {mine[k]} vs {theirs[k]}" for k in mine if mine[k] != theirs[k])
        raise HeadError(
            f"the EAGLE head trained for {trained} has another shape than the loaded model {name} ({differ}; "
            f"the head is in {directory}); {retrain}"
        )
    if trained_for != fingerprint:
        raise HeadError(
            f"the EAGLE head trained for {trained} does not match the loaded model {name} (fingerprints "
            f"{trained_for[:16]} vs {fingerprint[:16]}; the head is in {directory}); {retrain}"
        )
    head, draft_vocab = _read_tensors(directory, shape, fix)
    head.eval().requires_grad_(False)
    return LoadedHead(directory, head, draft_vocab, config)


def find(target: Any, directory: str | Path | None = None) -> LoadedHead:
    """The head for ``target``: from ``directory`` if given, else the one ``train-draft`` wrote for it
    (``head_dir``).  Raises ``HeadError`` (``load``'s), and when none was trained, one that says which
    ``mechserve train-draft`` to run."""
    fingerprint = model_fingerprint(target)
    if directory is not None:
        return load(Path(directory), target, fingerprint)
    found = head_dir(fingerprint)
    if not (found / CONFIG_FILE).is_file() and not (found / HEAD_FILE).is_file():
        raise HeadError(
            f"no EAGLE head has been trained for the loaded model {model_name(target)} (looked in {found}): run "
            f"`{train_command(target)}` first, or name one with --eagle-head DIR"
        )
    return load(found, target, fingerprint, cached=True)


def window_rows(window: int, steps: int) -> int:
    """Rows a training sequence needs so that every context a drafting step sees occurs in training."""
    return window + steps


def expected_kept(acceptance: list[float]) -> float:
    """Mean kept tokens per decode step when guess ``j`` (1-based) is accepted with the chain probability
    ``acceptance[j - 1]`` (already conditional on every guess before it): ``1 + sum of the prefix products``."""
    kept, alive = 1.0, 1.0
    for a in acceptance:
        alive *= a
        kept += alive
    return kept if math.isfinite(kept) else 1.0


__all__ = [
    "CONFIG_FILE",
    "DEFAULT_WINDOW",
    "HEAD_FILE",
    "EagleHead",
    "HeadConfig",
    "HeadError",
    "LoadedHead",
    "Shared",
    "expected_kept",
    "find",
    "head_dir",
    "load",
    "model_fingerprint",
    "model_name",
    "save",
    "train_command",
]
