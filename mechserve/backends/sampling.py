"""Token choice from logits, and the prompt-lookup (n-gram) draft proposer.

Sampling is greedy for now.  ``SamplingParams`` is registered per request
with the executor so later issues can add temperature, top-p, top-k and seeds
without changing the executor's step path: ``Sampler.choose`` already gets
every row's request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling parameters; only greedy (``temperature == 0``) is implemented."""

    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature != 0.0:
            raise NotImplementedError("only greedy sampling (temperature 0) is implemented")


GREEDY = SamplingParams()


class Sampler:
    """Chooses one token per logits row.

    A row's choice is the target token for the row's position: verifying a
    deterministic draft against it (accept a guess iff it equals the choice)
    is exact for greedy, and, because a prompt-lookup draft puts all its
    probability on one token, it is also exact rejection sampling once rows
    are sampled from the model's distribution.
    """

    def choose(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int]:
        """``logits``: [R, vocab] float32; ``params``: one per row.  Returns R token ids."""
        return logits.argmax(dim=-1).tolist()


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
