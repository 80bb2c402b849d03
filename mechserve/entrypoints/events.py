"""What crosses between the engine thread and its callers: prompts, admissions, per-step events, errors.

Standard library only, beside ``mechserve.api.outputs`` (whose ``SampleDelta``
and ``RequestOutput`` the events carry).
"""

from __future__ import annotations

from dataclasses import dataclass

from mechserve.api.outputs import RequestOutput, SampleDelta
from mechserve.api.params import SamplingParams

__all__ = ["Admission", "StreamEvent"]


@dataclass(frozen=True, slots=True)
class Admission:
    """An accepted request: its id, its prompt as text (None for ids) and the ids it runs with (after
    ``truncate_prompt_tokens``), and the params it runs with."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """What one engine step did for one request.

    ``samples``: the delta of each sample the step touched (index order;
    concatenating a sample's deltas gives its final text and ids);
    ``output``: the request's ``RequestOutput`` on its last event, else None.
    Each ``Logprob`` in the deltas carries its token's text (``decoded_token``).
    """

    request_id: str
    samples: tuple[SampleDelta, ...]
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last event."""
        return self.output is not None

    @property
    def text(self) -> str:
        """The text this step added to sample 0 (the only one with ``n = 1``)."""
        return "".join(d.text for d in self.samples if d.index == 0)

    @property
    def token_ids(self) -> list[int]:
        """The token ids this step added to sample 0."""
        return [t for d in self.samples if d.index == 0 for t in d.token_ids]
