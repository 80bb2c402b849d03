"""Paged KV cache and attention over a flattened batch.

Layout (owned here, documented once)::

    k[layer], v[layer]: [num_pages, page_size, num_kv_heads, head_dim]   (one tensor per side: [L, P, S, KV, D])
    slot = page_id * page_size + offset      flat view: [num_pages * page_size, num_kv_heads, head_dim]

A position's state lives at the slot its placement names; positions are read
back through the item's page table (``page_table[pos // page_size]``).  Pages
are the spec's pages one-to-one: the control side owns which page is free,
private or cached, this module only moves tensors.

One step is one flat batch of ``T`` tokens (every item of the plan, prefill
chunks and decode windows together, in plan order)::

    rows   0 .. T-1:  | item 0 (q0 tokens) | item 1 (q1) | ... |
    slot_mapping[T]:  where each row's K/V is written before anyone reads
    native items:     every item when the native kernel is enabled (decode steps,
                      decode windows of speculation, prefill chunks): attended straight
                      from the pages, each page read once per block of queries
                      (``mechserve.kv.native``);
    groups:           the items of the torch path (the kernel off, or dtypes it does not
                      take), bucketed by query length (1, 2, 3-4, 5-8, ...);
                      each group is one padded SDPA call: [B, Qmax] queries
                      against [B, Cmax] gathered context slots, masked so a
                      query at position p sees positions [0, p] (and, for a
                      sliding-window layer, only the last ``sliding_window`` of them).

GQA: the ``G = num_heads // num_kv_heads`` query heads that share a KV head
are folded into the query axis (``[B, KV, G * Qmax, D]``), so K/V are never
repeated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mechserve.kv import native as native_kernel
from mechserve.native.memory import huge_zeros


@dataclass(frozen=True, slots=True)
class Span:
    """One plan item as attention sees it.

    The item owns flat rows ``[row, row + num_tokens)`` of the step and
    computes positions ``[start, start + num_tokens)``; ``page_table`` backs
    every position ``< start + num_tokens``.
    """

    row: int
    start: int
    num_tokens: int
    page_table: Sequence[int]


@dataclass(slots=True)
class AttentionGroup:
    """Items attended in one padded call.

    ``rows``: [B * Qmax] int64 flat rows gathered as queries (padding repeats
    an item's first row), or None when the group is exactly rows ``0..T-1``
    in order; ``src``/``dst``: [N] int64, valid entries of the padded output
    and the flat rows they go to (None with ``rows``); ``kv_slots``:
    [B * Cmax] int64 context slots (padding points at slot 0 and is masked);
    ``masks``: sliding window (None = full causal) -> [B, 1, G * Qmax, Cmax] bool.
    """

    batch: int
    q_len: int
    ctx_len: int
    rows: torch.Tensor | None
    src: torch.Tensor | None
    dst: torch.Tensor | None
    kv_slots: torch.Tensor
    masks: dict[int | None, torch.Tensor]

    def to(self, device: torch.device) -> AttentionGroup:
        """This group with its tensors on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionGroup(
            self.batch,
            self.q_len,
            self.ctx_len,
            move(self.rows),
            move(self.src),
            move(self.dst),
            self.kv_slots.to(device, non_blocking=True),
            {w: m.to(device, non_blocking=True) for w, m in self.masks.items()},
        )


@dataclass(slots=True)
class NativeItems:
    """Items the native kernel attends: ``items`` [N, 4] int64 (first row, first position, query
    length, offset into ``tables``), ``tables`` int32 (their page tables, concatenated), and the
    spans themselves for the torch fallback (dtypes the kernel does not handle)."""

    spans: tuple[Span, ...]
    items: torch.Tensor
    tables: torch.Tensor
    fallback: tuple[AttentionGroup, ...] | None = None


@dataclass(slots=True)
class AttentionBatch:
    """Per-step attention metadata, built once and shared by every layer.

    ``slot_mapping``: [T] int64, the slot each flat row writes; ``native``: the items the native
    kernel attends (None when it is off or no item is short enough); ``groups``: the rest.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    native: NativeItems | None = None
    page_size: int = 0
    group_size: int = 1
    sliding_windows: tuple[int | None, ...] = (None,)

    def to(self, device: torch.device) -> AttentionBatch:
        """This batch with its index tensors and masks on ``device`` (``self`` on a CPU).

        The native kernel reads host memory, so on any other device its items are attended by the
        torch path (``native_fallback``): the one place where the device chooses the attention path.
        """
        if device.type == "cpu":
            return self
        groups = (self.native_fallback() if self.native is not None else ()) + self.groups
        return AttentionBatch(
            self.num_tokens,
            self.slot_mapping.to(device, non_blocking=True),
            tuple(g.to(device) for g in groups),
            None,
            self.page_size,
            self.group_size,
            self.sliding_windows,
        )

    def native_fallback(self) -> tuple[AttentionGroup, ...]:
        """The native items as SDPA groups (built once, for dtypes the kernel does not take)."""
        assert self.native is not None
        if self.native.fallback is None:
            self.native.fallback = _build_groups(
                list(self.native.spans), self.num_tokens, self.page_size, self.group_size, self.sliding_windows
            )
        return self.native.fallback


def _bucket(num_tokens: int) -> int:
    """Power-of-two bucket of a query length: 1 | 2 | 3-4 | 5-8 | ...; bounds padding to < 2x."""
    return (num_tokens - 1).bit_length()


def build_attention_batch(
    spans: Sequence[Span],
    slot_mapping: Sequence[int],
    page_size: int,
    group_size: int,
    sliding_windows: Sequence[int | None] = (None,),
    native: bool | None = None,
) -> AttentionBatch:
    """Route the items to the native kernel, or bucket them by query length and build each bucket's
    gather indices and masks (torch's path).

    ``sliding_windows`` lists the distinct per-layer sliding windows (None = full
    causal attention); one mask per sliding window per group is built.  ``native``:
    whether the items go to the kernel (None = ``mechserve.kv.native.enabled()``,
    which follows ``MECHSERVE_ATTENTION``).
    """
    num_tokens = sum(s.num_tokens for s in spans)
    if native is None:
        native = native_kernel.enabled()
    short = list(spans) if native else []
    rest = [] if native else list(spans)
    native_items = None
    if short:
        items: list[tuple[int, ...]] = []
        tables: list[int] = []
        for s in short:
            used = -(-(s.start + s.num_tokens) // page_size)
            items.append((s.row, s.start, s.num_tokens, len(tables)))
            tables.extend(s.page_table[:used])
        native_items = NativeItems(
            tuple(short), torch.tensor(items, dtype=torch.int64), torch.tensor(tables, dtype=torch.int32)
        )
    groups = _build_groups(rest, num_tokens, page_size, group_size, sliding_windows)
    return AttentionBatch(
        num_tokens,
        torch.tensor(slot_mapping, dtype=torch.int64),
        groups,
        native_items,
        page_size,
        group_size,
        tuple(sliding_windows),
    )


def _build_groups(
    spans: list[Span], num_tokens: int, page_size: int, group_size: int, sliding_windows: Sequence[int | None]
) -> tuple[AttentionGroup, ...]:
    buckets: dict[int, list[Span]] = {}
    for s in spans:
        buckets.setdefault(_bucket(s.num_tokens), []).append(s)
    return tuple(
        _build_group(members, num_tokens, page_size, group_size, sliding_windows)
        for _, members in sorted(buckets.items())
    )


def _build_group(
    spans: list[Span], num_tokens: int, page_size: int, group_size: int, sliding_windows: Sequence[int | None]
) -> AttentionGroup:
    batch = len(spans)
    q_len = max(s.num_tokens for s in spans)
    ctx_len = max(s.start + s.num_tokens for s in spans)
    num_pages = -(-ctx_len // page_size)
    lens = torch.tensor([s.num_tokens for s in spans])
    starts = torch.tensor([s.start for s in spans])
    first_rows = torch.tensor([s.row for s in spans])
    j = torch.arange(q_len)
    valid = j[None, :] < lens[:, None]  # [B, Qmax]
    jj = torch.where(valid, j[None, :], 0)
    q_pos = starts[:, None] + jj  # [B, Qmax]; padding repeats the item's first query
    rows = first_rows[:, None] + jj
    tables = torch.tensor(
        [list(s.page_table[:num_pages]) + [0] * (num_pages - len(s.page_table[:num_pages])) for s in spans]
    )
    k_pos = torch.arange(ctx_len)
    kv_slots = tables[:, k_pos // page_size] * page_size + k_pos % page_size  # [B, Cmax]
    causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Cmax]
    masks = {}
    for sliding_window in sliding_windows:
        mask = (
            causal if sliding_window is None else causal & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
        )
        masks[sliding_window] = (
            mask.unsqueeze(1).expand(batch, group_size, q_len, ctx_len).reshape(batch, 1, -1, ctx_len)
        )
    identity = (
        batch * q_len == num_tokens and bool(valid.all()) and bool((rows.view(-1) == torch.arange(num_tokens)).all())
    )
    if identity:
        return AttentionGroup(batch, q_len, ctx_len, None, None, None, kv_slots.view(-1), masks)
    src = torch.nonzero(valid.view(-1)).view(-1)
    return AttentionGroup(batch, q_len, ctx_len, rows.view(-1), src, rows.view(-1)[src], kv_slots.view(-1), masks)


class PagedKVCache:
    """K and V pages for every layer (layout in the module docstring).

    ``k``/``v``: [num_layers, num_pages, page_size, num_kv_heads, head_dim],
    ``dtype``, on ``device``; zero-filled at construction.  The gather workspaces are reused
    across layers and steps and grow only when a step needs more context.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":  # attention streams the pages: huge pages, fewer TLB misses
            self.k, self.v = huge_zeros(shape, dtype), huge_zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._ws_k = torch.empty(0, dtype=dtype, device=device)
        self._ws_v = torch.empty(0, dtype=dtype, device=device)
        # Each layer's pages as one [slots, KV, D] view, made once (a view is a few microseconds, per layer and step).
        self._flat = [
            (self.k[i].view(-1, num_kv_heads, head_dim), self.v[i].view(-1, num_kv_heads, head_dim))
            for i in range(num_layers)
        ]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as [num_pages * page_size, num_kv_heads, head_dim] views."""
        return self._flat[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ([T, num_kv_heads, head_dim]) at ``slot_mapping`` ([T] int64)."""
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` ([N] int64) as [N, num_kv_heads, head_dim] views of the workspaces."""
        n = slots.numel() * self.num_kv_heads * self.head_dim
        if self._ws_k.numel() < n:
            self._ws_k = torch.empty(n, dtype=self.k.dtype, device=self.k.device)
            self._ws_v = torch.empty(n, dtype=self.v.dtype, device=self.v.device)
        k_flat, v_flat = self.flat(layer)
        k = self._ws_k[:n].view(-1, self.num_kv_heads, self.head_dim)
        v = self._ws_v[:n].view(-1, self.num_kv_heads, self.head_dim)
        torch.index_select(k_flat, 0, slots, out=k)
        torch.index_select(v_flat, 0, slots, out=v)
        return k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into ``layer``'s pages, then attend every query to its request's context.

    ``q``: [T, num_heads, head_dim]; ``k``/``v``: [T, num_kv_heads,
    head_dim]; returns [T, num_heads * head_dim] (into ``out`` if given).
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = cache.num_kv_heads
    g = num_heads // kv_heads
    if out is None:
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    groups, nat = batch.groups, batch.native
    if nat is not None and native_kernel.supports(q.dtype, cache.k.dtype) and k.dtype == cache.k.dtype:
        # The kernel stores this step's K/V (every row, the SDPA groups' too) before it attends.
        k_flat, v_flat = cache.flat(layer)
        new = (k.contiguous(), v.contiguous(), batch.slot_mapping)
        native_kernel.paged_attention(
            q.contiguous(), k_flat, v_flat, out, nat.items, nat.tables, cache.page_size, scale, sliding_window, new
        )
    else:
        cache.write(layer, batch.slot_mapping, k, v)
        if nat is not None:
            groups = batch.native_fallback() + groups
    for grp in groups:
        b, ql, cl = grp.batch, grp.q_len, grp.ctx_len
        qg = q if grp.rows is None else q.index_select(0, grp.rows)  # [B * Qmax, H, D]
        qg = qg.view(b, ql, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * ql, head_dim)
        kc, vc = cache.gather(layer, grp.kv_slots)  # [B * Cmax, KV, D]
        kc = kc.view(b, cl, kv_heads, head_dim).transpose(1, 2)  # [B, KV, Cmax, D]
        vc = vc.view(b, cl, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg, kc.to(q.dtype), vc.to(q.dtype), attn_mask=grp.masks[sliding_window], scale=scale
        )
        o = o.view(b, kv_heads, g, ql, head_dim).permute(0, 3, 1, 2, 4).reshape(b * ql, num_heads * head_dim)
        if grp.rows is None:
            out.copy_(o)
        else:
            assert grp.src is not None and grp.dst is not None
            out.index_copy_(0, grp.dst, o.index_select(0, grp.src))
    return out
