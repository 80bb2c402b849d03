"""The torch executor: real weights and real paged KV tensors behind the m12 boundary.

Each ``execute(plan)`` is one forward over every plan item (see
``paged_kv`` for the flat-batch layout), then one outcome per item::

    item (start s, n tokens, k known ids)     positions s .. s+k-1: known ids
                                              positions s+k .. s+n-1: guesses (decode windows only)
    sampling item:  logits rows s+k-1 .. s+n-1  ->  targets t0 .. t(n-k)
                    row j chooses output token  generated + j
                    accept the leading guesses equal to t0, t1, ...  (a of them)
                    token_ids = guesses[:a] + [t_a]
    other item:     no logits, no ids

Targets come from ``Sampler.choose`` with the request's ``SamplingParams``;
row ``j`` carries the token index ``item.generated + j``, which is all a
seeded request's random draw depends on.

Verification is speculative sampling (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling"): accept a guess
``g`` with probability ``min(1, p(g) / q(g))``, else draw from
``norm(max(0, p - q))``.  A prompt-lookup draft is a point mass, ``q =
delta_g``, so that is exactly: draw ``t ~ p`` at the row and accept iff ``t ==
g``; on the first mismatch ``t`` itself is the correction; when every guess
is accepted, the next row's draw is the bonus token.  Greedy is the special
case where ``p`` is the argmax.

The executor keeps each request's token history (known ids from the plans,
plus its own accepted outputs) to propose guesses.  A plan may begin
mid-prompt after a prefix-cache hit: positions it never saw are kept as
unknown (-1) unless the prompt was registered with ``add_request``.  It
writes exactly the planned placements and reports them as its writes; the
control side decides what stays (rollback, EOS, stop ids, freeing pages).
Requests that ask for ``logprobs`` get one ``TokenLogprobs`` per appended id
on a side channel, ``take_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from mechserve.backends.llama import LlamaModel
from mechserve.backends.paged_kv import AttentionBatch, Span, build_attention_batch
from mechserve.backends.sampling import Row, Sampler, TokenLogprobs, propose_ngram, token_logprobs
from mechserve.params import GREEDY, SamplingParams
from mechserve.spec.m12_admission_control import Outcome, PlanItem

# (history, num) -> up to num guesses; the executor pads a short proposal with the last known id.
Proposer = Callable[[Sequence[int], int], Sequence[int]]


@dataclass(frozen=True, slots=True)
class _Sampling:
    """What sampling needs of one request: its params and the ids min_tokens bans."""

    params: SamplingParams
    banned: tuple[int, ...]


_DEFAULT = _Sampling(GREEDY, ())


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's flat batch.

    ``input_ids``/``positions``: [T] int64; ``logit_rows``: [R] int64 rows
    that sample, with ``rows`` (R entries); ``guesses``: per item, the ids
    placed after its known ids; ``logprob_rows``: per item, the indices
    into the R rows whose logprobs are recorded (empty for items that do
    not ask), and ``num_logprobs`` the N of each of those rows.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    logit_rows: torch.Tensor
    rows: list[Row]
    guesses: list[list[int]]
    logprob_rows: list[range]
    num_logprobs: list[int]


class TorchExecutor:
    """One rank executor running ``model`` on a paged KV cache of ``num_pages`` x ``page_size`` slots.

    The cache geometry must equal the engine's (the engine's page ids index
    this cache).  ``kv_dtype`` defaults to the model's dtype.  ``proposer``
    drafts the guesses of a decode window (default: prompt lookup with
    ``max_ngram``); ``sampler`` chooses tokens (default: a ``Sampler`` with
    a fresh seed for unseeded requests).
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
        proposer: Proposer | None = None,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.cache = model.new_cache(num_pages, page_size, kv_dtype)
        self.max_ngram = max_ngram
        self.sampler = sampler or Sampler()
        self.proposer: Proposer = proposer or partial(propose_ngram, max_ngram=max_ngram)
        self._history: dict[str, list[int]] = {}
        self._sampling: dict[str, _Sampling] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | None = None,
        params: SamplingParams = GREEDY,
        *,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Register a request's sampling params, its end ids and (optionally) its prompt, for drafting.

        While fewer than ``params.min_tokens`` tokens exist, the stop ids
        (``stop_token_ids`` and ``params.stop_token_ids``) and, unless
        ``params.ignore_eos``, the ``eos_token_ids`` are never chosen.  An
        unregistered request is greedy with no min_tokens.
        """
        ends = [*stop_token_ids, *params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        banned = tuple(dict.fromkeys(ends)) if params.min_tokens > 0 else ()
        self._sampling[request_id] = _Sampling(params, banned)
        self._logprobs.pop(request_id, None)
        if prompt_ids is not None:
            self._history[request_id] = list(prompt_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished request's history, params and untaken logprobs (take them first)."""
        self._history.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._logprobs.pop(request_id, None)

    def history(self, request_id: str) -> list[int]:
        """The ids this executor knows for ``request_id``, by position (-1 = unknown)."""
        return list(self._history.get(request_id, ()))

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """What was recorded for ``request_id`` since the last call, then forget it.

        One entry per id the executor appended (accepted guesses and the
        sampled id, in order), only for a request registered with
        ``params.logprobs`` set.  The control side may keep fewer ids than
        were appended (an EOS or stop id inside an accepted run, a length
        cap): cut to the step record's ``tokens``.
        """
        return self._logprobs.pop(request_id, [])

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        """Run one step: one forward over all items, then verdicts and sampled ids per item."""
        if not plan:
            return ()
        step = self._flatten(plan)
        logits = self.model.forward(step.input_ids, step.positions, self.cache, step.batch, step.logit_rows)
        targets = self.sampler.choose(logits, step.rows) if step.rows else []
        recorded = self._record_logprobs(step, logits, targets) if step.num_logprobs else None
        return self._verdicts(plan, step.guesses, targets, recorded)

    def _flatten(self, plan: tuple[PlanItem, ...]) -> _Step:
        """Lay the items out as one flat batch: known ids then guesses per item, in plan order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        logit_rows: list[int] = []
        rows: list[Row] = []
        guesses: list[list[int]] = []
        logprob_rows: list[range] = []
        num_logprobs: list[int] = []
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
            g = self._propose(hist, item.num_tokens - known)
            guesses.append(g)
            row = len(input_ids)
            spans.append(Span(row, item.start_position, item.num_tokens, item.page_table))
            input_ids += [*item.token_ids, *g]
            positions += [p for p, _, _ in item.placements]
            slots += [page * ps + offset for _, page, offset in item.placements]
            span = range(len(rows), len(rows) + len(g) + 1) if item.sample else range(0)
            if item.sample:
                # the last known row predicts the first guess; each guess row predicts the next
                logit_rows += range(row + known - 1, row + item.num_tokens)
                s = self._sampling.get(item.request_id, _DEFAULT)
                rows += [Row(s.params, item.generated + j, s.banned) for j in range(len(g) + 1)]
                if s.params.logprobs is not None:
                    num_logprobs += [s.params.logprobs] * len(span)
                else:
                    span = range(0)
            logprob_rows.append(span)
        arch = self.model.arch
        batch = build_attention_batch(
            spans, slots, ps, arch.num_heads // arch.num_kv_heads, self.model.distinct_windows
        )
        return _Step(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            batch=batch,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
            rows=rows,
            guesses=guesses,
            logprob_rows=logprob_rows,
            num_logprobs=num_logprobs,
        )

    def _propose(self, hist: list[int], num: int) -> list[int]:
        """Exactly ``num`` guesses: the proposer's, cut or padded with the last known id; never an unknown id."""
        if num <= 0:
            return []
        pad = hist[-1]
        g = [t if t >= 0 else pad for t in list(self.proposer(hist, num))[:num]]
        return g + [pad] * (num - len(g))

    def _record_logprobs(self, step: _Step, logits: torch.Tensor, targets: list[int]) -> list[list[TokenLogprobs]]:
        """Raw logprobs of the targets at the rows of items that ask; one list per item (empty if it does not)."""
        wanted = [i for span in step.logprob_rows for i in span]
        found = iter(token_logprobs(logits[wanted], [targets[i] for i in wanted], step.num_logprobs))
        return [[next(found) for _ in span] for span in step.logprob_rows]

    def _verdicts(
        self,
        plan: tuple[PlanItem, ...],
        guesses: list[list[int]],
        targets: list[int],
        recorded: list[list[TokenLogprobs]] | None,
    ) -> tuple[Outcome, ...]:
        """Accept each decode window's leading guesses that match the targets; append the ids to history."""
        outcomes = []
        offset = 0
        for n, (item, g) in enumerate(zip(plan, guesses)):
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
                if recorded is not None and recorded[n]:
                    # accepted guesses equal the targets, so the appended ids are t0 .. t_a
                    self._logprobs.setdefault(item.request_id, []).extend(recorded[n][: accepted + 1])
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
