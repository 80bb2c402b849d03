"""Draft proposers: what a decode window guesses, behind the executor boundary.

A proposer sees every plan item of a step as a ``Window`` (the item, the request's ids so far and the
number of guesses the window has room for) and returns one ``Draft`` per window: at most ``slots``
guesses, and for a draft that was sampled (not a point mass) the distributions ``q`` they were drawn
from.  The executor pads a short point-mass draft to fill the window (every planned position is
computed)::

    NgramProposer        prompt lookup: the longest suffix n-gram (min_n <= n <= max_n) of the
                         request's ids found earlier in them (earliest occurrence on ties); the ids
                         that followed it.  No model.
    CallableProposer     any ``(history, num) -> ids`` function (tests rig drafts with it; the
                         original lookup ``propose_ngram``, most recent match, is one)
    DraftModelProposer   a second Llama-family model with the same vocabulary: ``slots``
                         autoregressive rounds over its own paged KV (below)

``available(request, history, cap)`` says, before a step, how many guesses the proposer would have for
a request (the control side sizes windows with it); ``release(request, output_ids)`` tells it a request
left, with the output the executor knew (a proposer that learns across requests, such as suffix
decoding's global tree, learns from it); the registry of methods is ``mechserve.api.proposers``.

The draft model's KV (``DraftModelProposer``) has the target's geometry in pages (``num_pages`` x
``page_size``, its own layers and heads) and is read and written through the plan's page tables, so
a page the control side frees, caches, shares or rolls back holds draft state exactly as it holds
target state.  Each step writes the draft KV of every known position the target computes (so a
prompt page published to the cache carries valid draft KV for whoever reuses it) and of the guesses
it feeds back in; the last guess of a window is never fed back, so when every guess was accepted
the draft is one position behind and catches up from the request's ids in the next step::

    draft KV valid for [0, valid);  next item starts at s (the spec's computed)
    s <= valid (a rollback, a preemption, a prefix hit): valid := s, nothing to redo
    s >  valid (all guesses accepted last step):       rows valid .. s-1 from the history first

With output caching (m13) a page can be published while its last accepted guess still lacks draft KV,
and a request that finishes never catches up.  The proposer therefore remembers such slots (each
window's last guess, until a draft forward writes the slot) and a window whose pages below its start
hold one (a prefix hit on another request's generated block) recomputes the draft KV from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from mechserve.executor.sampling import STREAM_DRAFT, Row, Sampler, sampling_logits
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model.protocol import Model
from mechserve.spec.m16_request_draft_lengths import PlanItem

if TYPE_CHECKING:
    from mechserve.api.proposers import ProposerContext
    from mechserve.executor.request import ExecutorRequest


def propose_ngram(history: Sequence[int], num: int, max_ngram: int = 3, filler: int | None = None) -> list[int]:
    """``num`` guesses that continue ``history`` by prompt lookup.

    Finds the most recent earlier occurrence of the longest suffix n-gram
    (``max_ngram`` down to 1) and proposes the tokens that followed it.
    Unknown history entries are negative and never proposed; short or missing
    proposals are padded with ``filler`` (default: the last history token).
    """
    if num <= 0:
        return []
    arr = np.asarray(history, dtype=np.int64)
    n_hist = arr.shape[0]
    pad = int(arr[-1]) if filler is None else filler
    for n in range(min(max_ngram, n_hist - 1), 0, -1):
        suffix = arr[n_hist - n :]
        if (suffix < 0).any():
            continue
        # windows starting at i cover [i, i + n) with i + n <= n_hist - 1, so a follower exists
        windows = sliding_window_view(arr[: n_hist - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            follow = [int(t) for t in arr[i : i + num]]
            follow = [t if t >= 0 else pad for t in follow]
            return follow + [pad] * (num - len(follow))
    return [pad] * num


@dataclass(frozen=True, slots=True)
class Window:
    """One plan item as a proposer sees it.

    ``history``: the request's ids by position, ending at the item's last known id (-1 =
    unknown): its prompt (``request.prompt_ids``, the first ``request.prompt_len`` of them) then its
    output so far (``output``); ``slots``: the guess positions of the window (``num_tokens -
    len(token_ids)``, 0 for an item that is not a decode window); ``row``: the sampling row of the first
    guess (its params, token index ``item.generated``, min_tokens bans and the request's record; guess
    ``j`` has token index ``generated + j``).
    """

    item: PlanItem
    history: list[int]
    slots: int
    row: Row

    @property
    def request(self) -> ExecutorRequest:
        """The request's record (prompt ids, params, end ids)."""
        assert self.row.request is not None, "a window's row carries its request's record"
        return self.row.request

    @property
    def output(self) -> list[int]:
        """The request's output ids so far (``history`` after the prompt)."""
        return self.history[self.request.prompt_len :]


@dataclass(frozen=True, slots=True)
class Draft:
    """A window's guesses and, for sampled guesses, ``q``: [len(tokens), V] float32, the draft's
    distribution at each guess (None: every guess is a point mass)."""

    tokens: tuple[int, ...] = ()
    q: torch.Tensor | None = None


NO_DRAFT = Draft()


class Proposer(Protocol):
    """What proposes a decode window's guesses; built by its registry entry's ``build(ProposerContext)``
    (``mechserve.api.proposers``).

    ``propose(windows)``: one ``Draft`` per window of the step, in plan order (``len(draft.tokens) <=
    window.slots``; every window of the plan is given, its ``history`` ending at its last known id, so a
    proposer can keep per-request state in step with it); ``available(request, history, cap)``: before a
    step, how many of ``cap`` guesses it would have now (the governor sizes windows with it);
    ``release(request, output_ids)``: the request left, with the output ids the executor last knew (a
    stop string cut after the step may leave a few past the kept end).

    A proposer fed the target's hidden states (the EAGLE head, ``executor/proposers_eagle.py``) also has
    ``observe(request, position, ids, hidden)``: its registry entry sets ``hidden``, the target forward
    (``Model.forward``'s ``hidden_out``) returns the final hidden states ([rows, hidden] float32, after the
    last norm, before the LM head) at each sampling row, and after the verdicts the executor hands each
    request's kept rows (its last known row and its accepted guesses: positions ``position ..``, whose ids
    are ``ids``) to ``observe``; its next ``propose`` starts from them.
    """

    def propose(self, windows: Sequence[Window]) -> list[Draft]: ...

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int: ...

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None: ...


def lookup_ngram(history: Sequence[int], num: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``num`` ids that followed the longest suffix n-gram of ``history`` earlier in it.

    Tries ``n = max_n`` down to ``min_n``; takes the earliest occurrence that has a follower and
    returns the ids after it (fewer than ``num`` at the end of the history, and never past an
    unknown (negative) id).  No match: ``[]``.
    """
    length = len(history)
    if num <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(history, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        if (suffix < 0).any():
            continue
        # windows starting at i cover [i, i + n) with i + n <= length - 1, so a follower exists
        hits = np.flatnonzero((sliding_window_view(arr[: length - 1], n) == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            follow = arr[start : start + num]
            unknown = np.flatnonzero(follow < 0)
            return follow[: unknown[0] if unknown.size else num].tolist()
    return []


class NgramIndex:
    """One request's history with the earliest end of every n-gram in it that has a follower: ``lookup_ngram``'s
    answer in O(max_n) per lookup and per id appended, instead of a scan of the whole history per lookup.

    ``first[n]``: n-gram key -> the position of its earliest occurrence's last id, for the n-grams (``min_n <= n
    <= max_n``, no unknown id in them) that end before the history's last id.  A key packs the n ids into one
    int, 32 bits each (ids are below 2**32): dicts of ints only, which the cyclic garbage collector does not
    track.  ``sync(history)`` brings it to ``history``: the ids appended since, or all of it again when
    ``history`` is not an extension of what it holds (a rollback or a recompute cut it; one list comparison).
    """

    __slots__ = ("first", "ids", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.first: list[dict[int, int]] = [{} for _ in range(max_n + 1)]

    @staticmethod
    def _key(ids: Sequence[int]) -> int:
        key = 0
        for t in ids:
            key = (key << 32) | t
        return key

    def sync(self, history: Sequence[int]) -> None:
        """Hold ``history``'s ids (appending the new ones, or rebuilt when it does not extend what is held)."""
        ids = self.ids
        held = len(ids)
        if len(history) < held or list(history[:held]) != ids:
            self.ids = ids = []
            self.first = [{} for _ in range(self.max_n + 1)]
            held = 0
        first = self.first
        for e in range(held, len(history)):
            # the n-grams ending at e - 1 now have a follower (id e): the earliest of each is kept
            for n in range(self.min_n, min(self.max_n, e) + 1):
                gram = ids[e - n : e]
                if min(gram) >= 0:
                    first[n].setdefault(self._key(gram), e - 1)
            ids.append(int(history[e]))

    def lookup(self, num: int) -> list[int]:
        """``lookup_ngram(history, num, min_n, max_n)`` for the history held."""
        ids = self.ids
        length = len(ids)
        if num <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = ids[length - n :]
            if min(suffix) < 0:
                continue
            end = self.first[n].get(self._key(suffix))
            if end is not None:
                follow = ids[end + 1 : end + 1 + num]
                cut = next((j for j, t in enumerate(follow) if t < 0), len(follow))
                return follow[:cut]
        return []


class NgramProposer:
    """Prompt lookup: ``lookup_ngram`` with ``min_n``..``max_n``, answered from each request's ``NgramIndex``
    (kept in step with its history, dropped at ``release``)."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> NgramProposer:
        """The registry's factory: the n-gram bounds of ``ctx.speculative``."""
        return cls(ctx.speculative.ngram_min, ctx.speculative.ngram_max)

    def _lookup(self, request: ExecutorRequest, history: Sequence[int], num: int) -> list[int]:
        index = self._index.get(request.request_id)
        if index is None:
            index = self._index[request.request_id] = NgramIndex(self.min_n, self.max_n)
        index.sync(history)
        return index.lookup(num)

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        return [
            Draft(tuple(found)) if w.slots and (found := self._lookup(w.request, w.history, w.slots)) else NO_DRAFT
            for w in windows
        ]

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        return len(self._lookup(request, history, cap))

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        self._index.pop(request.request_id, None)


class CallableProposer:
    """Point-mass guesses from ``fn(history, num)``: its first ``num`` ids, up to the first unknown one."""

    def __init__(self, fn: Callable[[Sequence[int], int], Sequence[int]]) -> None:
        self.fn = fn

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        drafts = []
        for w in windows:
            ids = self._ids(w.history, w.slots)
            drafts.append(Draft(tuple(ids)) if ids else NO_DRAFT)
        return drafts

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        return len(self._ids(history, cap))

    def _ids(self, history: Sequence[int], num: int) -> list[int]:
        ids = [int(t) for t in list(self.fn(history, num))[:num]] if num > 0 else []
        cut = next((j for j, t in enumerate(ids) if t < 0), len(ids))
        return ids[:cut]

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        pass


class DraftModelProposer:
    """Guesses from ``model`` (same vocabulary as the target) over its own paged KV (module docstring).

    Each step: round 1 is one forward over every item's known rows (plus catch-up rows), with
    logits at the last known row of each window; round ``r`` feeds guess ``r - 1`` of each window
    with more than ``r - 1`` slots.  Every window gets exactly ``slots`` guesses.  A greedy
    request's guess is the draft's argmax (a point mass); a sampling request's guess is drawn from
    the draft's distribution after the request's own min_tokens bans, temperature, top-k, top-p and
    min-p (``Sampler.probs``), from the seeded stream ``STREAM_DRAFT`` at the guess's token index,
    and ``q`` ([V] float32 per guess) is kept for verification.
    """

    def __init__(
        self,
        model: Model,
        num_pages: int,
        page_size: int,
        sampler: Sampler,
        *,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.cache = model.new_cache(num_pages, page_size, kv_dtype)
        self.sampler = sampler
        self._valid: dict[str, int] = {}
        # page -> offsets whose target KV a step wrote but this draft did not (a window's last guess)
        self._stale: dict[int, set[int]] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> DraftModelProposer:
        """The registry's factory: ``ctx.draft`` over pages of the pool's geometry."""
        return cls(ctx.draft, ctx.num_pages, ctx.page_size, ctx.sampler, kv_dtype=ctx.kv_dtype)

    def valid(self, request_id: str) -> int | None:
        """Leading positions of ``request_id`` whose draft KV is valid (None: not seen yet)."""
        return self._valid.get(request_id)

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        return cap

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        self._valid.pop(request.request_id, None)

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        caps = [w.slots for w in windows]
        guesses: list[list[int]] = [[] for _ in windows]
        qs: list[list[torch.Tensor]] = [[] for _ in windows]
        drafting = self._first_round(windows, caps, guesses, qs)
        for r in range(2, max(caps, default=0) + 1):
            drafting = [i for i in drafting if caps[i] >= r]
            self._next_round(windows, drafting, r, guesses, qs)
        ps = self.page_size
        for i, w in enumerate(windows):
            known_end = w.item.start_position + len(w.item.token_ids)
            self._valid[w.item.request_id] = known_end + max(0, len(guesses[i]) - 1)
            if guesses[i]:
                last = known_end + len(guesses[i]) - 1
                self._stale.setdefault(w.item.page_table[last // ps], set()).add(last % ps)
        return [Draft(tuple(g), torch.stack(q) if q else None) if g else NO_DRAFT for g, q in zip(guesses, qs)]

    def _first_round(
        self, windows: Sequence[Window], caps: list[int], guesses: list[list[int]], qs: list[list[torch.Tensor]]
    ) -> list[int]:
        """One forward over catch-up and known rows of every item; the first guess of each drafting window."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        logit_rows: list[int] = []
        drafting: list[int] = []
        for i, w in enumerate(windows):
            item = w.item
            start = item.start_position
            first = self._stale_before(min(self._valid.get(item.request_id, start), start), item.page_table, w.history)
            lag = w.history[first:start]
            if any(t < 0 for t in lag):  # never happens: a lag is only ever accepted guesses
                raise AssertionError(f"{item.request_id}: draft catch-up over unknown ids")
            row = len(ids)
            ids += [*lag, *item.token_ids]
            end = start + len(item.token_ids)
            positions += range(first, end)
            table = item.page_table
            slots += [table[p // ps] * ps + p % ps for p in range(first, end)]
            spans.append(Span(row, first, end - first, table))
            if caps[i] > 0:
                logit_rows.append(len(ids) - 1)
                drafting.append(i)
        self._forward(ids, positions, slots, spans, logit_rows, windows, drafting, 1, guesses, qs)
        return drafting

    def _stale_before(self, end: int, table: Sequence[int], history: Sequence[int]) -> int:
        """The earliest position below ``end`` whose slot lacks draft KV and from which the ids are known,
        else ``end``: where a window reading ``table`` must start recomputing the draft KV."""
        if not self._stale:
            return end
        ps = self.page_size
        for i, page in enumerate(table[: -(-end // ps)]):
            offsets = self._stale.get(page)
            if offsets:
                p = i * ps + min(offsets)
                return p if p < end and min(history[p:end], default=0) >= 0 else end
        return end

    def _next_round(
        self,
        windows: Sequence[Window],
        drafting: list[int],
        r: int,
        guesses: list[list[int]],
        qs: list[list[torch.Tensor]],
    ) -> None:
        """Feed guess ``r - 1`` of each drafting window; choose guess ``r``."""
        if not drafting:
            return
        ps = self.page_size
        ids, positions, slots, spans = [], [], [], []
        for row, i in enumerate(drafting):
            item = windows[i].item
            pos = item.start_position + len(item.token_ids) + r - 2
            ids.append(guesses[i][-1])
            positions.append(pos)
            slots.append(item.page_table[pos // ps] * ps + pos % ps)
            spans.append(Span(row, pos, 1, item.page_table))
        self._forward(ids, positions, slots, spans, list(range(len(drafting))), windows, drafting, r, guesses, qs)

    def _forward(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        spans: list[Span],
        logit_rows: list[int],
        windows: Sequence[Window],
        drafting: list[int],
        r: int,
        guesses: list[list[int]],
        qs: list[list[torch.Tensor]],
    ) -> None:
        """One draft forward (writes its KV); guess ``r`` of each of ``drafting`` from ``logit_rows``."""
        if not ids:
            return
        if self._stale:
            for slot in slots:
                offsets = self._stale.get(slot // self.page_size)
                if offsets is not None:
                    offsets.discard(slot % self.page_size)
                    if not offsets:
                        del self._stale[slot // self.page_size]
        arch = self.model.arch
        batch = build_attention_batch(
            spans, slots, self.page_size, arch.num_heads // arch.num_kv_heads, self.model.distinct_sliding_windows
        )
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            self.cache,
            batch,
            torch.tensor(logit_rows, dtype=torch.int64),
        )
        if not drafting:
            return
        rows = [_guess_row(windows[i].row, r, guesses[i]) for i in drafting]
        logits = sampling_logits(logits, rows)
        if all(row.params.greedy for row in rows):
            for i, t in zip(drafting, self.sampler.choose(logits, rows)):
                guesses[i].append(t)
            return
        probs = self.sampler.probs(logits, rows)  # [W, V]
        sampled = [j for j, row in enumerate(rows) if not row.params.greedy]
        drawn = dict(zip(sampled, self.sampler.draw(probs[sampled], [rows[j] for j in sampled], STREAM_DRAFT)))
        for j, i in enumerate(drafting):
            if j in drawn:
                guesses[i].append(drawn[j])
                qs[i].append(probs[j])
            else:
                guesses[i].append(int(probs[j].argmax()))


def _guess_row(first: Row, r: int, earlier: Sequence[int]) -> Row:
    """The sampling row of guess ``r`` (1-based) of a window whose first guess's row is ``first``: its
    token index, and for penalties and filters the history extended by the ``earlier`` guesses."""
    row = first._replace(token_index=first.token_index + r - 1)
    return row._replace(history=(*first.history, *earlier)) if first.params.filtered else row


__all__ = [
    "NO_DRAFT",
    "CallableProposer",
    "Draft",
    "DraftModelProposer",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "Window",
    "lookup_ngram",
    "propose_ngram",
]
