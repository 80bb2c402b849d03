"""The EAGLE proposer (``--spec-method eagle``): chain drafts from a head fed the target's hidden states.

The head (``mechserve.model.eagle``, trained by ``mechserve train-draft``) needs the target's feature (final
hidden state) at every row it reads.  The registry entry asks for them (``ProposerMethod.hidden``): the
target forward returns them at each sampling row, and after the verdicts the executor hands each request's
kept rows to ``observe`` (the last known row and the accepted guesses: their ids are the request's).  Per
request the proposer keeps the features of its last ``window`` positions::

    history (ids by position) ... t_{L-1} t_L          L: the window's last known position
    features kept             ... f_{L-2} f_{L-1}      (none yet for L: its row is computed this step)
    head rows                 (f_p, t_{p+1}) for p = L - window .. L - 1, then its own chain

A window drafts only when ``f_{L-1}`` is known (a request's first decode step after its prefill has it: the
prefill's sampling row; after ids the target never computed, forced ids (m14) or a prefix-cache hit that
skipped the prompt's last row, it has none and the window is padded until the next step computes it).
Features at or past ``L`` (a rollback, a cut at a stop id, a preemption) are dropped, and a feature whose
position's id changed is dropped with everything after it.

A window the governor sat out (no slots) costs a dict entry: ``propose`` does not look at it, and ``observe``
keeps its one row as a view of the step's features (no copy, no host sync), so a request that drafts again
after sitting out reads the same features as one that drafted all along.

Guesses are the head's argmax (point masses) for every request, sampling ones included: verification draws
``t ~ p`` and accepts while ``t`` equals the guess, so the emitted ids are distributed as without
speculation (and a seeded request's ids do not change at all).  ``vocab`` (FR-Spec, Zhao et al. 2025,
arXiv 2502.14856): the head's argmax over only the first ``vocab`` ids of its frequency-ranked draft
vocabulary (0: the whole vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mechserve.api.errors import HeadError
from mechserve.executor.governor import Governor
from mechserve.executor.proposers import NO_DRAFT, Draft, Window
from mechserve.model.eagle import LoadedHead, Shared, find
from mechserve.model.protocol import Model

if TYPE_CHECKING:
    from mechserve.api.proposers import ProposerContext
    from mechserve.executor.request import ExecutorRequest


@dataclass(slots=True)
class _Features:
    """One request's kept features: position -> (the id at that position, [hidden] float32); ``top``: the
    highest position held (-1: none)."""

    rows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    top: int = -1


class EagleProposer:
    """Chain drafting with an EAGLE head (module docstring) for ``target``."""

    def __init__(self, target: object, loaded: LoadedHead, vocab: int = 0) -> None:
        """Raises ``HeadError`` when ``vocab`` asks for more ids than the head ranks (the model's vocabulary)."""
        ranked = loaded.draft_vocab.numel()
        if vocab > ranked:
            raise HeadError(
                f"eagle_draft_vocab {vocab} is more than the {ranked} ids the EAGLE head in {loaded.directory} ranks "
                f"(the model's vocabulary): give 1 to {ranked} (--eagle-draft-vocab N), or 0 for all of them"
            )
        self.loaded = loaded
        self.head = loaded.head
        self.window = loaded.head.config.window
        ids = loaded.draft_vocab[:vocab].contiguous() if vocab else None
        self.shared = Shared(target, ids)
        self._features: dict[str, _Features] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> EagleProposer:
        """The registry's factory: the head ``ctx.speculative.eagle_head`` names, else the one trained for
        ``ctx.model`` (``mechserve.model.eagle.find``; ``HeadError`` when there is none, it is unreadable, it
        does not match the model or ``eagle_draft_vocab`` does not fit it)."""
        spec = ctx.speculative
        loaded = find(ctx.model, spec.eagle_head)
        return cls(ctx.model, loaded, spec.eagle_draft_vocab)

    def observe(self, request: ExecutorRequest, position: int, ids: Sequence[int], hidden: torch.Tensor) -> None:
        """The target's features of ``request`` at ``position`` .. ``position + n - 1`` (``hidden``: [n, hidden]
        float32), whose ids are ``ids`` (n of them)."""
        state = self._features.setdefault(request.request_id, _Features())
        rows = state.rows
        end = position + len(ids)
        for p in range(end, state.top + 1):  # past the newest row: a future that was rolled back or cut
            rows.pop(p, None)
        state.top = end - 1
        for j, t in enumerate(ids):
            rows[position + j] = (int(t), hidden[j])  # a view of the step's features: no copy, no host sync
        # Positions below ``low`` are never read again: a window reads at most ``window`` rows before its last.
        # They go once more than ``window + 1`` are kept (one comparison per step while a request sits out).
        if len(rows) > self.window + 1:
            low = position + len(ids) - self.window - 1
            for p in [p for p in rows if p < low]:
                del rows[p]

    def _context(self, w: Window) -> list[int]:
        """The positions whose features the window's head rows read (ending at ``L - 1``; empty: none)."""
        state = self._features.get(w.item.request_id)
        if state is None:
            return []
        rows, hist = state.rows, w.history
        last = len(hist) - 1
        for p in [p for p in rows if p >= last or hist[p] != rows[p][0]]:
            del rows[p]
        found: list[int] = []
        p = last - 1
        while p >= 0 and p in rows and len(found) < self.window and hist[p + 1] >= 0:
            found.append(p)
            p -= 1
        return found[::-1]

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        state = self._features.get(request.request_id)
        last = len(history) - 1
        if state is None or last < 1 or (last - 1) not in state.rows:
            return 0
        return cap if state.rows[last - 1][0] == history[last - 1] else 0

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        self._features.pop(request.request_id, None)

    def calibrate(self, windows: int, rounds: int) -> None:
        """A representative draft for timing (``executor.costs.calibrate``): ``rounds`` guesses for each of
        ``windows`` windows with a full context of ``window`` rows (placeholder ids and features); keeps no
        state."""
        w = self.window
        ids = torch.zeros(windows, w, dtype=torch.int64)
        positions = torch.arange(w, dtype=torch.int64).expand(windows, w)
        valid = torch.ones(windows, w, dtype=torch.bool)
        feats = torch.zeros(windows, w, self.head.config.hidden, dtype=torch.float32)
        self.head.draft(self.shared, ids, feats, positions, valid, rounds)

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        drafts = [NO_DRAFT] * len(windows)
        ready: list[tuple[int, list[int]]] = []
        for i, w in enumerate(windows):
            if w.slots <= 0:  # a window the governor sat out (or a prompt chunk): its features are not read
                continue
            context = self._context(w)
            if context:
                ready.append((i, context))
        if not ready:
            return drafts
        width = max(len(c) for _, c in ready)
        hidden = self.head.config.hidden
        b = len(ready)
        ids = torch.zeros(b, width, dtype=torch.int64)
        positions = torch.zeros(b, width, dtype=torch.int64)
        valid = torch.zeros(b, width, dtype=torch.bool)
        feats = torch.zeros(b, width, hidden, dtype=torch.float32)
        for j, (i, context) in enumerate(ready):
            w = windows[i]
            rows = self._features[w.item.request_id].rows
            pad = width - len(context)
            ids[j, pad:] = torch.tensor([w.history[p + 1] for p in context])
            positions[j, pad:] = torch.tensor(context)
            valid[j, pad:] = True
            feats[j, pad:] = torch.stack([rows[p][1] for p in context])
        steps = max(windows[i].slots for i, _ in ready)
        guesses = self.head.draft(self.shared, ids, feats, positions, valid, steps).tolist()
        for j, (i, _) in enumerate(ready):
            drafts[i] = Draft(tuple(guesses[j][: windows[i].slots]))
        return drafts


def eagle_governor(proposer: EagleProposer, model: object, target: Model, max_k: int) -> Governor:
    """The registry's governor for ``eagle``: each draft round priced, before anything is measured, at what
    the head reads next to one target step: its own layer and ``fc`` (float32) and the LM head rows of the
    draft vocabulary in use (FR-Spec's subset, float32, or the target's whole LM head as stored), over the
    target's decoder layers and LM head (``Model.weight_elements``), in bytes.  ``model`` (no draft model) is
    unused.  The executor measures the real rounds (``executor.costs``); this is the prior."""
    head_bytes = 4 * sum(p.numel() for p in proposer.head.parameters())
    hidden = proposer.head.config.hidden
    # bytes per target weight: GGUF blocks (q8_0: 34 bytes per 32 weights, q4_1: 20), else its dtype's
    blocks = {"q8_0": 34 / 32, "q4_1": 20 / 32}
    target_size = blocks.get(getattr(target, "quantization", None) or "", target.dtype.itemsize)
    sub = proposer.shared.vocab_ids
    vocab = target.arch.vocab_size if sub is None else int(sub.numel())
    lm_bytes = vocab * hidden * (target_size if sub is None else 4)
    layers, lm_head = target.weight_elements()
    per_round = (head_bytes + lm_bytes) / ((layers + lm_head) * target_size)
    return Governor(draft_costs=(per_round,) * max_k)


__all__ = ["EagleProposer", "eagle_governor"]
