"""Speculative sampling's verdict on a window drafted from a distribution (Leviathan et al. 2023; Chen et al. 2023).

See ``mechserve.executor.sampling`` for the rule in full and ``mechserve.executor.torch_executor`` for where
it runs: point-mass drafts (prompt lookup, greedy requests) need no ``q`` and are verified by
drawing from ``p`` and comparing; windows a draft model sampled from ``q`` go through
``verify_draft``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_draft(
    p: torch.Tensor, q: torch.Tensor, guesses: Sequence[int], uniforms: Sequence[float]
) -> tuple[int, torch.Tensor]:
    """Speculative sampling's verdict on one window (Leviathan et al. 2023; Chen et al. 2023).

    ``p``: [k+1, V] float32, the target's distributions at the window's rows
    (row j chooses the id after ``j`` accepted guesses); ``q``: [k, V] float32,
    the draft's distributions that ``guesses`` (k ids, ``guesses[j] ~ q[j]``)
    were drawn from; ``uniforms``: k independent U ~ uniform[0, 1).  Guess
    ``j`` is accepted iff ``u_j * q_j(g_j) < p_j(g_j)`` (probability
    ``min(1, p/q)``; never when ``p_j(g_j) == 0``).  Returns ``(a, dist)``:
    the number of leading guesses accepted and the unnormalised [V]
    distribution the next id must be drawn from: the residual
    ``max(0, p_a - q_a)`` after a rejection at ``a``, else ``p_k`` (the bonus).
    Rows of ``p``/``q`` need not be normalised alike: each is normalised here.
    """
    k = len(guesses)
    if k == 0:
        return 0, p[0]
    idx = torch.tensor(list(guesses), dtype=torch.int64)
    pn = p[:k] / p[:k].sum(dim=-1, keepdim=True)  # [k, V]
    qn = q[:k] / q[:k].sum(dim=-1, keepdim=True)
    pg = pn.gather(1, idx[:, None]).squeeze(1).tolist()
    qg = qn.gather(1, idx[:, None]).squeeze(1).tolist()
    for j in range(k):
        if not uniforms[j] * qg[j] < pg[j]:
            residual = (pn[j] - qn[j]).clamp_(min=0.0)
            if not bool(residual.sum() > 0):  # p == q up to rounding: the residual is p itself
                residual = pn[j]
            return j, residual
    return k, p[k]


__all__ = ["verify_draft"]
