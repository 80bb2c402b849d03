"""Megatron-style tensor parallelism for the Llama family: how a model splits, and one rank's shard.

Every rank holds a slice of every layer and runs the same step on the same flat batch; two
all-reduces per layer and one all-gather for the logits make the ranks' partial results whole
(Shoeybi et al. 2019, "Megatron-LM", section 3)::

    ids ─> vocab-parallel embedding (rows v0..v1 of this rank; others' ids give 0) ─> all-reduce ─> x
    per layer:
      x ─> RMSNorm ─> column-parallel QKV (this rank's Q heads, the KV heads they read)
        ─> RoPE ─> paged attention on this rank's KV pages ─> row-parallel O ─> all-reduce ─> + x (+ o bias)
      x ─> RMSNorm ─> column-parallel gate/up (intermediate i0..i1) ─> SiLU * up
        ─> row-parallel down ─> all-reduce ─> + x (+ down bias)
    x ─> RMSNorm ─> vocab-parallel LM head (rows v0..v1) ─> all-gather ─> [R, vocab] logits on every rank

Head split (``HeadSplit``).  Q heads are dealt out in contiguous ranges as possible:
rank ``r`` of ``W`` gets ``H // W`` heads, one more for ``r < H % W``.  A rank keeps the KV
heads its Q heads read (``q // (H // KV)``), so a KV head whose group straddles two ranks is
*replicated* on both; when ``W`` divides ``KV`` nothing is replicated.  SmolLM2 (9 Q heads, 3 KV
heads, groups of 3)::

    W=2:  rank 0: Q 0-4 -> KV 0 (Q 0,1,2), KV 1 (Q 3,4)      rank 1: Q 5-8 -> KV 1 (Q 5), KV 2 (Q 6,7,8)
    W=4:  rank 0: Q 0-2 -> KV 0    rank 1: Q 3,4 -> KV 1    rank 2: Q 5,6 -> KV 1, KV 2    rank 3: Q 7,8 -> KV 2

A rank's groups may then be uneven (KV 0 has 3 local Q heads, KV 1 two).  Paged attention wants
``G`` query heads per KV head, so the rank attends with ``G = max`` local group size and pads
the short groups with zero query heads whose outputs are dropped before O; the KV pages hold
only the real local KV heads.  The cost is a little wasted attention arithmetic on a rank with
uneven groups, never extra KV memory beyond the replicated heads.

The intermediate size splits the same way (contiguous, as possible); the vocabulary
splits into ``ceil(V / W)``-row blocks (the last may be shorter; its logits are padded for the
all-gather and the padding dropped).  Norms and the row-parallel biases are replicated.  Which
tensor splits along which axis is the weight-name map's (``model/weights.py``: a rank keeps its
span of every Q, KV, intermediate and vocabulary axis), and a rank reads only its slices from the
safetensors files (``formats.SafetensorsFiles``), so it never holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mechserve.kv.paged import AttentionBatch, PagedKVCache, paged_attention
from mechserve.model.arch import LlamaArch
from mechserve.model.formats import SafetensorsFiles
from mechserve.model.layer import LayerWeights
from mechserve.model.linear import linear
from mechserve.model.llama import LlamaModel, _rotate, rms_norm, rope_inv_freq
from mechserve.model.weights import Dim, Span, assemble


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``total`` items split into ``parts`` contiguous parts,
    sizes differing by at most one (the first ``total % parts`` parts get the extra item)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """One rank's share of the attention heads (see the module docstring).

    ``q``: the rank's Q heads ``[q0, q1)``; ``kv``: the KV heads they read ``[kv0, kv1)``;
    ``group``: the padded query heads per local KV head; ``slots``: for each local Q head, in
    order, its index among the ``(kv1 - kv0) * group`` padded heads (None when nothing is padded).
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    group: int
    slots: tuple[int, ...] | None

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadSplit:
        """Rank ``rank``'s heads; ``ValueError`` if there are fewer Q heads than ranks."""
        if world_size > num_heads:
            raise ValueError(f"world size {world_size} exceeds the model's {num_heads} attention heads")
        g = num_heads // num_kv_heads
        q0, q1 = even_split(num_heads, world_size, rank)
        kv0, kv1 = q0 // g, (q1 - 1) // g + 1
        counts = [sum(1 for q in range(q0, q1) if q // g == kv) for kv in range(kv0, kv1)]
        group = max(counts)
        slots = tuple((q // g - kv0) * group + (q - max(q0, (q // g) * g)) for q in range(q0, q1))
        return cls((q0, q1), (kv0, kv1), group, None if q1 - q0 == (kv1 - kv0) * group else slots)

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


@dataclass(frozen=True, slots=True)
class RankShape:
    """Everything rank ``rank`` of ``world_size`` holds of a model shaped ``arch``.

    ``heads``: its ``HeadSplit``; ``inter``: its intermediate rows ``[i0, i1)``; ``vocab``: its
    vocabulary rows ``[v0, v1)``; ``vocab_block``: ``ceil(vocab / world_size)``, every rank's
    logits width in the all-gather.
    """

    rank: int
    world_size: int
    heads: HeadSplit
    inter: tuple[int, int]
    vocab: tuple[int, int]
    vocab_block: int

    @classmethod
    def of(cls, arch: LlamaArch, world_size: int, rank: int) -> RankShape:
        """Raises ``ValueError`` for a world size larger than the heads, the intermediate size or the vocabulary."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if world_size > min(arch.intermediate_size, arch.vocab_size):
            raise ValueError(f"world size {world_size} exceeds the model's intermediate size or vocabulary")
        block = -(-arch.vocab_size // world_size)
        v0 = min(rank * block, arch.vocab_size)
        return cls(
            rank,
            world_size,
            HeadSplit.of(arch.num_heads, arch.num_kv_heads, world_size, rank),
            even_split(arch.intermediate_size, world_size, rank),
            (v0, min(v0 + block, arch.vocab_size)),
            block,
        )


class ShardedLlama(LlamaModel):
    """Rank ``rank``'s shard of a Llama-family checkpoint, with the tensor-parallel forward.

    It is a ``LlamaModel`` to the executor: ``arch`` is the *local* shape (``num_heads`` = the
    padded local query heads, ``num_kv_heads`` = the local KV heads, everything else the model's),
    so ``new_cache`` allocates only this rank's KV heads and the executor's attention metadata uses
    the local group size; ``full_arch`` is the model's.  ``forward`` must be called on every rank
    of the default process group with the same arguments; it returns the full ``[R, vocab]``
    float32 logits on every rank.  Raises ``ModelLoadError`` for a checkpoint it cannot read and
    ``ValueError`` for a world size the model cannot split into.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int,
        world_size: int,
        dtype: torch.dtype = torch.float32,
        *,
        arch: LlamaArch,
        rope: tuple[torch.Tensor, float],
        config: Any = None,
    ) -> None:
        """Rank ``rank``'s slices of the checkpoint directory ``path`` for a model shaped ``arch`` with RoPE
        ``rope`` (``rope_inv_freq``'s frequencies and scaling), given by the driver so that a rank never
        imports transformers (``loader.load_shard`` reads them from the config when they are not)."""
        self.config = config
        self.full_arch = full = arch
        self.shape = shape = RankShape.of(full, world_size, rank)
        hs = shape.heads
        self.arch = replace(full, num_heads=hs.num_kv * hs.group, num_kv_heads=hs.num_kv)
        self.dtype = dtype
        self.quantization = None
        d, (q0, q1), (kv0, kv1) = full.head_dim, hs.q, hs.kv
        split: dict[Dim, Span] = {
            "q": (q0 * d, q1 * d),
            "kv": (kv0 * d, kv1 * d),
            "inter": shape.inter,
            "vocab": shape.vocab,
        }
        with SafetensorsFiles(Path(path), dtype) as files:
            weights = assemble(files, full, split)
        self.embed, self.norm, self.lm_head, self.layers = weights.embed, weights.norm, weights.lm_head, weights.layers
        self.inv_freq, self.rope_scaling = rope
        self.scale = full.head_dim**-0.5
        self.distinct_sliding_windows = tuple(dict.fromkeys(full.sliding_windows))
        self._slots = None if hs.slots is None else torch.tensor(hs.slots, dtype=torch.int64)

    def truncated(self, num_layers: int) -> LlamaModel:
        raise NotImplementedError("a sharded model cannot serve as a draft model")

    def parameter_counts(self) -> dict[str, int]:
        """Elements this rank holds, by kind: ``sharded`` (Q, O, MLP, vocabulary slices: a partition of
        the model's), ``kv`` (K/V projection rows, KV heads replicated where groups straddle ranks)
        and ``replicated`` (norms and row-parallel biases, whole on every rank)."""
        d, hs, hidden = self.full_arch.head_dim, self.shape.heads, self.full_arch.hidden_size
        counts = {"sharded": self.embed.numel() + (self.lm_head.numel() if self.lm_head is not self.embed else 0)}
        counts["kv"] = 0
        counts["replicated"] = self.norm.numel()
        for w in self.layers:
            kv_rows = 2 * hs.num_kv * d
            counts["kv"] += kv_rows * hidden + (kv_rows if w.qkv_bias is not None else 0)
            counts["sharded"] += w.qkv.numel() - kv_rows * hidden + w.o.numel() + w.gate_up.numel() + w.down.numel()
            if w.qkv_bias is not None:
                counts["sharded"] += w.qkv_bias.numel() - kv_rows
            if w.gate_up_bias is not None:
                counts["sharded"] += w.gate_up_bias.numel()
            for r in (w.input_norm, w.post_norm, w.q_norm, w.k_norm, w.o_bias, w.down_bias):
                counts["replicated"] += 0 if r is None else r.numel()
        return counts

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows, zeros for ids it does not hold, summed over ranks."""
        v0, v1 = self.shape.vocab
        mine = (input_ids >= v0) & (input_ids < v1)
        local = (input_ids - v0).clamp(0, max(v1 - v0 - 1, 0))
        assert isinstance(self.embed, torch.Tensor)  # a rank's shard is never quantized (EngineConfig refuses it)
        x = self.embed.index_select(0, local) * mine[:, None].to(self.dtype)  # [T, hidden]
        dist.all_reduce(x)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel LM head: this rank's ``[R, V_r]`` logits, all-gathered into ``[R, vocab]`` float32."""
        local = linear(x, self.lm_head).float()
        block = self.shape.vocab_block
        if local.shape[1] < block:
            local = F.pad(local, (0, block - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.shape.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, : self.full_arch.vocab_size]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, i: int, batch: AttentionBatch
    ) -> torch.Tensor:
        """Paged attention over this rank's heads: ``q`` [T, Q_r, D] -> [T, Q_r * D] (padded groups undone)."""
        t, d = q.shape[0], q.shape[2]
        if self._slots is None:
            return paged_attention(q, k, v, cache, i, batch, self.scale, self.full_arch.sliding_windows[i])
        padded = q.new_zeros(t, self.arch.num_heads, d)
        padded.index_copy_(1, self._slots, q)
        out = paged_attention(padded, k, v, cache, i, batch, self.scale, self.full_arch.sliding_windows[i])
        return out.view(t, -1, d).index_select(1, self._slots).reshape(t, -1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        batch: AttentionBatch,
        logit_rows: torch.Tensor | None = None,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One step of this rank (``LlamaModel.forward``'s contract; a collective call, see the class).
        ``hidden_out`` is refused (``NotImplementedError``): a hidden-state proposer runs on one rank."""
        if hidden_out is not None:
            raise NotImplementedError("a tensor-parallel rank does not return hidden states (an EAGLE head)")
        a, hs = self.full_arch, self.shape.heads
        d = a.head_dim
        cos, sin = self.rope(positions)
        x = self._embed(input_ids)
        for i, w in enumerate(self.layers):
            y = rms_norm(x, w.input_norm, a.rms_norm_eps)
            qkv = linear(y, w.qkv, w.qkv_bias)  # [T, (Q_r + 2 KV_r) * D]
            q, k, v = torch.split(qkv, [hs.num_q * d, hs.num_kv * d, hs.num_kv * d], dim=-1)
            q, k, v = q.view(-1, hs.num_q, d), k.view(-1, hs.num_kv, d), v.view(-1, hs.num_kv, d)
            if w.q_norm is not None and w.k_norm is not None:
                q, k = rms_norm(q, w.q_norm, a.rms_norm_eps), rms_norm(k, w.k_norm, a.rms_norm_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            part = linear(self._attend(q, k, v, cache, i, batch), w.o)  # [T, hidden], this rank's heads
            dist.all_reduce(part)
            x = x + (part if w.o_bias is None else part + w.o_bias)
            y = rms_norm(x, w.post_norm, a.rms_norm_eps)
            gate, up = linear(y, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [T, I_r] each
            part = linear(F.silu(gate) * up, w.down)
            dist.all_reduce(part)
            x = x + (part if w.down_bias is None else part + w.down_bias)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        return self._logits(rms_norm(x, self.norm, a.rms_norm_eps))


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the driver of a rank group needs of a Llama-shaped model without its weights (a
    ``model.protocol.ModelShape``): the transformers ``config``, ``arch``, ``dtype`` and RoPE
    (``inv_freq``, ``rope_scaling``, passed on to the ranks); the ranks hold the weights."""

    config: Any
    arch: LlamaArch
    dtype: torch.dtype
    inv_freq: torch.Tensor
    rope_scaling: float
    quantization: str | None = None  # the ranks' weights are floats (EngineConfig refuses quantization there)

    @classmethod
    def of(cls, config: Any, arch: LlamaArch, dtype: torch.dtype) -> LlamaShape:
        """The shape ``arch`` of a transformers ``config``; ``ModelLoadError`` for a RoPE ``LlamaModel`` cannot run."""
        return cls(config, arch, dtype, *rope_inv_freq(config, arch.head_dim))


def full_parameter_count(model: Any) -> int:
    """Elements of a whole ``LlamaModel``'s weights (a tied LM head counted once)."""
    seen: dict[int, int] = {}
    tensors = [model.embed, model.lm_head, model.norm]
    for w in model.layers:
        tensors += [getattr(w, f) for f in LayerWeights.__slots__]
    for t in tensors:
        if t is not None:
            seen[id(t)] = t.numel()
    return sum(seen.values())


__all__ = ["HeadSplit", "LlamaShape", "RankShape", "ShardedLlama", "even_split", "full_parameter_count"]
