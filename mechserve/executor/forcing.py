"""Forced runs behind the boundary (m14): where a request's ids come from when its grammar allows one continuation.

A ``ForcedSource`` is the executor's per-request view of a grammar (for a constrained request, its
matcher): after the executor appends a sampling item's ids (the accepted guesses and the sampled
id) it tells the source with ``consume_tokens``, asks ``forced_tokens`` for the ids the grammar
allows as the only continuation now, and reports them in ``Outcome.forced``; the source is told of
those too, so it is always at the end of the request's output.  The control side (m14) appends them
without sampling and computes them in the next step like a prefill chunk (SGLang's compressed FSM,
"jump-forward decoding": Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language
Model Programs", NeurIPS; llguidance calls them fast-forward tokens)::

    sample t ── consume_tokens([.., t]) ── forced_tokens() -> [f1 .. fk] ── consume_tokens([f1 .. fk])
             ── Outcome(token_ids=(.., t), forced=(f1 .. fk))

The control side may keep fewer forced ids than reported (``max_tokens``, a stop id inside the
run): the request then ends, so a source ahead of what was kept is never asked again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ForcedSource(Protocol):
    """A request's grammar as far as forcing goes: told every id appended, asked what is forced next."""

    def consume_tokens(self, ids: Sequence[int]) -> None:
        """``ids`` were appended to the request's output, in order (sampled, accepted or forced ids)."""
        ...

    def forced_tokens(self) -> list[int]:
        """The ids the grammar allows as the only continuation after everything consumed ([] if none)."""
        ...


class ScriptedForcer:
    """A ``ForcedSource`` that forces, after output index ``i`` of ``reference``, its next ``runs[i]`` ids.

    ``reference``: the output ids the request is known to produce (for instance its greedy output
    without forcing); forcing them changes no id, so a run with this source checks that forcing is
    exact and counts what it saves.  ``consumed`` are the ids told so far.
    """

    def __init__(self, reference: Sequence[int], runs: dict[int, int]) -> None:
        self.reference = list(reference)
        self.runs = dict(runs)
        self.consumed: list[int] = []

    def consume_tokens(self, ids: Sequence[int]) -> None:
        self.consumed += ids

    def forced_tokens(self) -> list[int]:
        n = len(self.consumed)
        k = self.runs.get(n - 1, 0)
        return self.reference[n : n + k] if n and k else []


__all__ = ["ForcedSource", "ScriptedForcer"]
