"""The torch executor: real weights and real paged KV tensors behind the m10/m11 boundary.

Each ``execute(plan)`` is one forward over every plan item (see
``paged_kv`` for the flat-batch layout), then one outcome per item::

    item (start s, n tokens, k known ids)     positions s .. s+k-1: known ids
                                              positions s+k .. s+n-1: guesses (decode windows only)
    sampling item:  logits rows s+k-1 .. s+n-1  ->  targets t0 .. t(n-k)
                    accept the leading guesses equal to t0, t1, ...  (a of them)
                    token_ids = guesses[:a] + [t_a]
    other item:     no logits, no ids

The executor keeps each request's token history (known ids from the plans,
plus its own accepted outputs) to propose guesses by prompt lookup.  A plan
may begin mid-prompt after a prefix-cache hit: positions it never saw are
kept as unknown (-1) unless the prompt was registered with ``add_request``.
It writes exactly the planned placements and reports them as its writes;
the control side decides what stays (rollback, EOS, freeing pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mechserve.backends.llama import LlamaModel
from mechserve.backends.paged_kv import AttentionBatch, Span, build_attention_batch
from mechserve.backends.sampling import GREEDY, Sampler, SamplingParams, propose_ngram
from mechserve.spec.m11_parallelism import Outcome, PlanItem


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's flat batch.

    ``input_ids``/``positions``: [T] int64; ``logit_rows``: [R] int64 rows
    that sample, with ``row_params`` (R entries); ``guesses``: per item, the
    ids placed after its known ids.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    logit_rows: torch.Tensor
    row_params: list[SamplingParams]
    guesses: list[list[int]]


class TorchExecutor:
    """One rank executor running ``model`` on a paged KV cache of ``num_pages`` x ``page_size`` slots.

    The cache geometry must equal the engine's (the engine's page ids index
    this cache).  ``kv_dtype`` defaults to the model's dtype.
    """

    def __init__(
        self,
        model: LlamaModel,
        num_pages: int,
        page_size: int,
        *,
        kv_dtype: torch.dtype | None = None,
        max_ngram: int = 3,
        sampler: Sampler | None = None,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.cache = model.new_cache(num_pages, page_size, kv_dtype)
        self.max_ngram = max_ngram
        self.sampler = sampler or Sampler()
        self._history: dict[str, list[int]] = {}
        self._params: dict[str, SamplingParams] = {}

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int] | None = None, params: SamplingParams = GREEDY
    ) -> None:
        """Register a request's sampling params and (optionally) its prompt, for drafting."""
        self._params[request_id] = params
        if prompt_ids is not None:
            self._history[request_id] = list(prompt_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished request's history and params."""
        self._history.pop(request_id, None)
        self._params.pop(request_id, None)

    def history(self, request_id: str) -> list[int]:
        """The ids this executor knows for ``request_id``, by position (-1 = unknown)."""
        return list(self._history.get(request_id, ()))

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        """Run one step: one forward over all items, then verdicts and sampled ids per item."""
        if not plan:
            return ()
        step = self._flatten(plan)
        logits = self.model.forward(step.input_ids, step.positions, self.cache, step.batch, step.logit_rows)
        targets = self.sampler.choose(logits, step.row_params) if step.row_params else []
        return self._verdicts(plan, step.guesses, targets)

    def _flatten(self, plan: tuple[PlanItem, ...]) -> _Step:
        """Lay the items out as one flat batch: known ids then guesses per item, in plan order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        logit_rows: list[int] = []
        row_params: list[SamplingParams] = []
        guesses: list[list[int]] = []
        ps = self.page_size
        for item in plan:
            hist = self._observe(item)
            known = len(item.token_ids)
            if not 0 < known <= item.num_tokens:
                raise ValueError(f"{item.request_id}: {known} known id(s) for {item.num_tokens} token(s)")
            if len(item.page_table) * ps < item.start_position + item.num_tokens:
                raise ValueError(
                    f"{item.request_id}: page table does not back position {item.start_position + item.num_tokens - 1}"
                )
            g = propose_ngram(hist, item.num_tokens - known, self.max_ngram)
            guesses.append(g)
            row = len(input_ids)
            spans.append(Span(row, item.start_position, item.num_tokens, item.page_table))
            input_ids += [*item.token_ids, *g]
            positions += [p for p, _, _ in item.placements]
            slots += [page * ps + offset for _, page, offset in item.placements]
            if item.sample:
                # the last known row predicts the first guess; each guess row predicts the next
                logit_rows += range(row + known - 1, row + item.num_tokens)
                row_params += [self._params.get(item.request_id, GREEDY)] * (len(g) + 1)
        arch = self.model.arch
        batch = build_attention_batch(
            spans, slots, ps, arch.num_heads // arch.num_kv_heads, self.model.distinct_windows
        )
        return _Step(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            batch=batch,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
            row_params=row_params,
            guesses=guesses,
        )

    def _verdicts(
        self, plan: tuple[PlanItem, ...], guesses: list[list[int]], targets: list[int]
    ) -> tuple[Outcome, ...]:
        """Accept each decode window's leading guesses that match the targets; append the ids to history."""
        outcomes = []
        offset = 0
        for item, g in zip(plan, guesses):
            accepted = 0
            ids: tuple[int, ...] = ()
            if item.sample:
                t = targets[offset : offset + len(g) + 1]
                offset += len(g) + 1
                if item.decode:
                    while accepted < len(g) and g[accepted] == t[accepted]:
                        accepted += 1
                ids = (*g[:accepted], t[accepted])
                self._history[item.request_id] += ids
            outcomes.append(
                Outcome(item.request_id, item.start_position, item.num_tokens, accepted, item.placements, ids)
            )
        return tuple(outcomes)

    def _observe(self, item: PlanItem) -> list[int]:
        """Update the request's history with the item's known ids; it then ends at the first guess."""
        hist = self._history.setdefault(item.request_id, [])
        start = item.start_position
        if len(hist) < start:
            hist.extend([-1] * (start - len(hist)))
        del hist[start:]
        hist.extend(item.token_ids)
        return hist
