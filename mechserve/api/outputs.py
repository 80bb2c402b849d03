"""What the engine hands back: per-request outputs (vLLM's shapes) and per-step deltas (standard library only).

``RequestOutput`` / ``CompletionOutput`` mirror vLLM's classes of the same
names, so code written against vLLM's ``LLM.generate`` reads them unchanged.
``SampleDelta`` and ``StepOutput`` are what ``EngineCore.step`` returns: the
spec's step record plus, per output, what that step added.

Finish reasons are vLLM's (OpenAI's): ``"length"`` (``max_tokens`` reached),
``"stop"`` (EOS, a stop token id or a stop string; ``stop_reason`` says which:
None for EOS, the id, or the string) and ``"abort"``.

Logprobs are vLLM's shape (``vllm/logprobs.py``): one ``dict[int, Logprob]`` per
position, the chosen (or prompt) token first, then the top N by rank::

    CompletionOutput.logprobs      [{chosen_id: Logprob, top1_id: Logprob, ...}, ...]   one per token id
    RequestOutput.prompt_logprobs  [None, {prompt_id_1: Logprob, top...}, ...]           one per prompt id
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mechserve.api.errors import RequestFailed
from mechserve.spec.m16_request_draft_lengths import StepRecord

LENGTH = "length"
STOP = "stop"
ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's ``Logprob``: one token's log-probability at one position.

    ``logprob``: natural log, of the model's raw distribution (before temperature, penalties and
    masks); ``rank``: the number of ids at least as likely, itself included (1 = the most likely;
    vLLM's rank), and for the top N their place 1 .. N; ``decoded_token``: the token's text on its
    own (None without a tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs, vLLM's shape: the chosen (or prompt) token first, then the top N.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """What an executor records at one position (its side channel; users see ``PositionLogprobs``).

    ``token_id`` (the chosen id, or the prompt id) and its ``logprob``; ``rank`` as in
    ``Logprob``; ``top_ids`` / ``top_logprobs`` are the N most likely ids, most likely first
    (N = the request's ``logprobs`` or ``prompt_logprobs``; 0 gives only the token itself).
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def to_dict(self, decode: Callable[[int], str | None] = lambda token_id: None) -> PositionLogprobs:
        """vLLM's shape: the token first, then the top N by rank (N or N + 1 entries); ``decode`` gives
        each id's ``decoded_token``."""
        out = {self.token_id: Logprob(self.logprob, self.rank, decode(self.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(self.top_ids, self.top_logprobs), 1):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, decode(token_id))
        return out


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample of a request.

    ``text`` is the generated text (cut before a matched stop string unless
    ``include_stop_str_in_output``; the text of an ending EOS or stop id is
    not included); ``token_ids`` are the ids the text came from (an ending
    EOS or stop id included, ids after a stop string's last character not);
    ``logprobs`` has one ``dict[int, Logprob]`` per id (the chosen id first,
    then the top N; vLLM's shape) when the request asked for them, else
    None; ``cumulative_logprob`` is the sum of the chosen ids' logprobs
    (None without logprobs).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this sample has ended (vLLM's method of the same name)."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings of one request, in seconds from ``time.perf_counter()`` (only differences are meaningful).

    ``arrival_time``: when it was submitted; ``scheduled_time``: when the scheduler first admitted
    it (a sample of it); ``first_token_time``: when the step that produced its first token (any
    sample) returned; ``finished_time``: when its last sample ended; ``token_times[i][k]``: when
    sample ``i``'s token ``k`` was produced (tokens of one step share a time).  vLLM's request
    phases follow from them::

        arrival ── queue ──> scheduled ── prefill ──> first token ── decode ──> finished
        |<──────────────── TTFT ────────────────────>|
        |<────────────────────────────── e2e ─────────────────────────────────>|
    """

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    token_times: tuple[tuple[float, ...], ...] = ()
    scheduled_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds (None if no token was produced)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, seconds from submission to the end (None while running)."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission to admission (None if never admitted)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """Seconds from admission to the first token (None without both)."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.scheduled_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first token to the end (None without both)."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's result: its prompt and one ``CompletionOutput`` per sample (``n`` of them, index order).

    ``prompt_token_ids`` are the ids the model saw (after ``truncate_prompt_tokens``);
    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``) has one entry per prompt id: None
    for the first, then a ``dict[int, Logprob]`` with the prompt id first and the top N (vLLM's
    shape); None when not asked for, or when the request ended before its prompt was computed.
    ``num_cached_tokens`` (vLLM's field): the prompt tokens served from the prefix cache when the
    request was first admitted (whole pages; 0 before admission).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one step added to one sample: new ids (and logprobs), streamable text, and whether it ended.

    ``text`` never contains characters that a later stop-string match would
    retract, nor half of a multi-byte character; the concatenation of a
    sample's deltas is its final ``CompletionOutput.text``, and likewise for
    ``token_ids`` and ``logprobs``.  ``prompt_logprobs`` is the request's
    ``RequestOutput.prompt_logprobs``, on the first delta of sample 0 that has
    them (else None).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One engine step: the spec's ``record``, the per-sample ``deltas`` and the requests that ``finished``.

    ``failed``: the requests that failed inside this step on their own account (request id -> the
    error; ``RequestFailed``), which end with that error instead of an output.  For the serving metrics:
    ``prompt_tokens`` is the prompt length of each request the step admitted with tokens to generate,
    ``prefix_hits`` the tokens of those prompts served from the prefix cache, ``preemptions`` the
    victims that had computed state to drop.
    """

    record: StepRecord
    deltas: tuple[SampleDelta, ...] = ()
    finished: tuple[RequestOutput, ...] = field(default=())
    failed: Mapping[str, RequestFailed] = field(default_factory=dict)
    prompt_tokens: Mapping[str, int] = field(default_factory=dict)
    prefix_hits: int = 0
    preemptions: int = 0


__all__ = [
    "ABORT",
    "LENGTH",
    "STOP",
    "CompletionOutput",
    "Logprob",
    "PositionLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleDelta",
    "StepOutput",
    "TokenLogprobs",
]
