"""A submitted request in front of the boundary: its ``n`` samples, their kept ids, text and timings.

The scheduler (m14) knows one request per sample (``"<id>#<j>"`` for ``n > 1``) and its token ids;
``EngineCore`` keeps, for each, what the user gets back: the ids it keeps (``Sample.keep``: the text,
incremental detokenization and stop strings by ``OutputText``, decides how many of a step's ids stay),
logprobs, the times that vLLM's ``RequestOutput.metrics`` reports, and its finish (``Sample.end``:
the one place where m14's finish reasons become vLLM's)::

    RequestGroup  request_id, prompt, prompt ids, arrival/admission/first-token times, error (it failed)
      └─ Sample   engine id, params, OutputText, kept ids and logprobs, token times, finish
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mechserve.api.errors import RequestFailed
from mechserve.api.outputs import (
    LENGTH,
    STOP,
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleDelta,
    TokenLogprobs,
)
from mechserve.api.params import SamplingParams
from mechserve.engine.detokenizer import OutputText
from mechserve.spec import m16_request_draft_lengths as m16


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

    @classmethod
    def new(
        cls, engine_id: str, index: int, params: SamplingParams, tokenizer: Any, prompt_ids: Sequence[int]
    ) -> Sample:
        """A sample whose text is decoded by ``tokenizer`` (None: empty texts) after ``prompt_ids``."""
        skip = params.skip_special_tokens

        def decode(ids: Sequence[int]) -> str:
            return "" if tokenizer is None else str(tokenizer.decode(list(ids), skip_special_tokens=skip))

        text = OutputText(decode, prompt_ids, params.stop, params.include_stop_str_in_output, params.min_tokens)
        return cls(engine_id, index, params, text, logprobs=[] if params.logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def keep(
        self,
        ids: Sequence[int],
        reason: m16.FinishReason | None,
        now: float,
        taken: Sequence[TokenLogprobs] = (),
        to_vllm: Callable[[TokenLogprobs], PositionLogprobs] = TokenLogprobs.to_dict,
    ) -> int | None:
        """Take the ids a step appended (``taken``: the executor's logprobs of them, when asked for, shown
        as ``to_vllm`` gives them); return None, or how many of them the sample keeps because its text
        ended it (a stop string; m12 N26's stop from outside).

        The ids are detokenized one at a time and the text searched for stop strings: a match ends the
        sample after the id that completed it.  ``reason``: m14's finish reason if the step ended the
        request (its last id, an EOS or stop id, adds no text unless ``include_stop_str_in_output``;
        the held-back bytes are released and may still complete a stop string, which then ends it with
        all its ids).  A prompt-only sample keeps none."""
        if self.prompt_only:
            return 0
        kept, stop = len(ids), None
        ends_on_id = reason in (m16.FinishReason.EOS, m16.FinishReason.STOP)
        for k, token_id in enumerate(ids):
            is_end_id = ends_on_id and k == len(ids) - 1
            stop = self.text.push(token_id, detokenize=not is_end_id or self.params.include_stop_str_in_output)
            if stop is not None:
                kept = k + 1
                break
        if stop is None and reason is not None:
            stop = self.text.finish()
        self.new_ids += ids[:kept]
        self.token_ids += ids[:kept]
        self.token_times += [now] * kept
        if self.logprobs is not None:
            entries = [to_vllm(lp) for lp in taken[:kept]]
            self.new_logprobs += entries
            self.logprobs += entries
            self.cumulative_logprob += sum(lp.logprob for lp in taken[:kept])
        return kept if stop is not None else None

    def end(self, reason: m16.FinishReason) -> None:
        """The engine ended this sample with m14's ``reason``: its finish reason and stop reason as vLLM
        reports them (the one place where m14's reasons are mapped)::

            prompt-only sample (max_tokens 0)   "length"                        (m14: STOP, kept 0)
            a stop string ended it              "stop", the stop string         (m14: STOP)
            a stop id                           "stop", the id                  (m14: STOP)
            an EOS id                           "stop", None                    (m14: EOS)
            max_tokens                          "length"                        (m14: LENGTH)
        """
        self.text.finish()  # a sample that ended without ids still releases what its text held back
        if self.prompt_only or (reason is m16.FinishReason.LENGTH and self.text.stop is None):
            self.finish_reason, self.stop_reason = LENGTH, None
        elif self.text.stop is not None:
            self.finish_reason, self.stop_reason = STOP, self.text.stop
        elif reason is m16.FinishReason.STOP:
            self.finish_reason, self.stop_reason = STOP, self.token_ids[-1] if self.token_ids else None
        else:
            self.finish_reason, self.stop_reason = STOP, None

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
    ``num_cached_tokens``: the prompt tokens the prefix cache served at its first admission;
    ``error``: why it failed inside a step (it then ends with no output, only this error).
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
    error: RequestFailed | None = None

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
