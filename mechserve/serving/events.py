"""What crosses between the engine thread and its callers: prompts, admissions, per-step events, errors.

Standard library only, beside ``mechserve.outputs`` (whose ``SampleDelta``
and ``RequestOutput`` the events carry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mechserve.outputs import RequestOutput, SampleDelta
from mechserve.params import SamplingParams

__all__ = ["NO_TEXT", "Admission", "Chat", "EngineDeadError", "EngineStepError", "PromptInput", "StreamEvent"]

NO_TEXT: Mapping[int, str] = MappingProxyType({})  # the token_text of an event without logprobs


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or dead after a failed step)."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment ends with this error."""


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation as a prompt: ``messages`` (``{"role", "content"}`` dicts) through the model's chat template."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    chat_template: str | None = None


PromptInput = str | Sequence[int] | Mapping[str, Any] | Chat


@dataclass(frozen=True, slots=True)
class Admission:
    """An accepted request: its id, its prompt as text (None for ids) and ids, and the params it runs with."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """What one engine step did for one request.

    ``samples``: the delta of each sample the step touched (index order;
    concatenating a sample's deltas gives its final text and ids);
    ``output``: the request's ``RequestOutput`` on its last event, else None;
    ``token_text``: the text of each token id named in the deltas' logprobs
    (only when the request asked for logprobs).
    """

    request_id: str
    samples: tuple[SampleDelta, ...]
    output: RequestOutput | None = None
    token_text: Mapping[int, str] = field(default_factory=lambda: NO_TEXT)

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
