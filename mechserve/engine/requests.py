"""A submitted request in front of the boundary: its ``n`` samples, their kept ids, text and timings.

The scheduler (m13) knows one request per sample (``"<id>#<j>"`` for ``n > 1``) and its token ids;
``EngineCore`` keeps, for each, what the user gets back: the ids it keeps after the stop cuts, the
text (``OutputText``: incremental detokenization and stop strings), logprobs, and the times that
vLLM's ``RequestOutput.metrics`` reports::

    RequestGroup  request_id, prompt, prompt ids, arrival/admission/first-token times
      └─ Sample   engine id, params, OutputText, kept ids and logprobs, token times, finish
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mechserve.api.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput, SampleDelta
from mechserve.api.params import SamplingParams
from mechserve.engine.detokenizer import OutputText


@dataclass(eq=False)
class Sample:
    """One sample of a request: the m13 request ``engine_id``, its kept ids, text and finish.

    ``prompt_only``: a request for prompt logprobs with ``max_tokens`` 0, run by m13 with one new
    token that is never kept (m13 finishes a request of no new token at admission, unrun).
    """

    engine_id: str
    index: int
    params: SamplingParams
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_only: bool = False
    # Kept since the last delta (ids and logprobs).
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self, request_id: str, prompt_logprobs: list[PositionLogprobs | None] | None = None) -> SampleDelta:
        """What this sample gained since the last delta (streamable text, ids, logprobs, its finish);
        ``prompt_logprobs`` rides along (the request's, on its first delta that has them)."""
        delta = SampleDelta(
            request_id=request_id,
            index=self.index,
            token_ids=self.new_ids,
            text=self.text.take(final=self.finished),
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.new_logprobs if self.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
        )
        self.new_ids, self.new_logprobs = [], []
        return delta

    def completion(self) -> CompletionOutput:
        """This sample as vLLM's ``CompletionOutput``."""
        return CompletionOutput(
            index=self.index,
            text=self.text.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


@dataclass(eq=False)
class RequestGroup:
    """One submitted request: its ``n`` samples and its times (seconds of ``time.perf_counter()``).

    ``arrival_time``: submission; ``scheduled_time``: when a sample was first admitted (the end of
    its queue time); ``first_token_time``: when the step that produced its first token returned.
    ``prompt_logprobs``: vLLM's shape, once sample 0 has computed its prompt (with
    ``params.prompt_logprobs``); ``prompt_logprobs_sent``: whether a delta has carried them;
    ``num_cached_tokens``: the prompt tokens the prefix cache served at its first admission.
    """

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    samples: list[Sample]
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def delta(self, sample: Sample) -> SampleDelta:
        """``sample``'s delta; the first of sample 0 after the prompt logprobs exist carries them."""
        prompt_logprobs = None
        if sample.index == 0 and self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return sample.delta(self.request_id, prompt_logprobs)

    def output(self, now: float | None = None) -> RequestOutput:
        """The ``RequestOutput`` as it stands (``now``: its end time, if it has ended)."""
        finished = self.finished
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=now if finished else None,
            token_times=tuple(tuple(s.token_times) for s in self.samples),
            scheduled_time=self.scheduled_time,
        )
        completions = [s.completion() for s in self.samples]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_ids),
            completions,
            finished,
            metrics,
            self.prompt_logprobs,
            self.num_cached_tokens,
        )


__all__ = ["RequestGroup", "Sample"]
