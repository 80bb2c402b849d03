"""Admission in front of the door: a request's checks that need the model, and its fan-out into samples.

``EngineCore.add_request`` runs these in order, then offers each sample to m12's door::

    checked_params(params)               a SamplingParams (or ValueError)
    prompt_ids(ids, params, vocab, ctx)  the ids as ints, each in the vocabulary, truncated as vLLM truncates
    check_ids(params, vocab)             stop_token_ids, logit_bias and allowed_token_ids inside the vocabulary
    check_samples(params, max_waiting)   n samples can ever wait at once
    samples(request_id, params)          one SampleSpec per sample: m14's id ("<id>#<j>" for n > 1), the
                                         sample's params (seed + j; only sample 0 computes prompt logprobs)
                                         and the new tokens m14 runs (a prompt-logprobs request with
                                         max_tokens 0 runs one, which it keeps none of)
    reject_detail(reason, ...)           the limit behind a door refusal, in words
    Grammars(...).compile(so)            a constraint compiled for the model's tokenizer (any thread; cached)

Every check raises ``ParamError`` (a ``ValueError`` naming the field) before anything is admitted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.executor.structured import CompiledGrammar, GrammarCompiler
from mechserve.spec import m16_request_draft_lengths as m16


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One sample of a request as m14 runs it: its m14 ``engine_id``, ``index`` among the request's
    samples, its ``params`` and the ``max_new_tokens`` m14 runs; ``prompt_only``: a prompt-logprobs
    request with ``max_tokens`` 0, run with one new token that is never kept."""

    engine_id: str
    index: int
    params: SamplingParams
    max_new_tokens: int
    prompt_only: bool = False


def checked_params(params: SamplingParams | None) -> SamplingParams:
    """``params``, or vLLM's defaults for None; ``ValueError`` for anything but a ``SamplingParams``."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def prompt_ids(ids: Sequence[int], params: SamplingParams, vocab_size: int, context: int | None) -> list[int]:
    """The prompt as a list of ints, each a token id of a vocabulary of ``vocab_size``, keeping the last
    ``params.truncate_prompt_tokens`` (-1: ``context``, the model's) as vLLM truncates.

    Raises ``ParamError("prompt", ...)`` for text or an id outside the vocabulary, and
    ``ParamError("truncate_prompt_tokens", ...)`` for more than ``context`` (as vLLM does)."""
    if isinstance(ids, str | bytes):
        raise ParamError("prompt", "prompt_ids must be a sequence of token ids, not text (encode it first)")
    found = list(ids)
    for pos, t in enumerate(found):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ParamError(
                "prompt",
                f"prompt token id {t!r} at position {pos} is not a token id of this model ({_vocabulary(vocab_size)})",
            )
    keep = params.truncate_prompt_tokens
    if keep is None:
        return found
    if context is not None and keep > context:  # vLLM refuses it too: it could never keep that many
        raise ParamError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens {keep} is more than the model's context (max_model_len {context}); "
            "give at most that, or -1 for the context",
        )
    keep = context if keep == -1 and context is not None else keep
    return found[-keep:] if 0 < keep < len(found) else found


def check_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ParamError`` naming the field for an id outside the vocabulary in ``stop_token_ids``,
    ``logit_bias`` or ``allowed_token_ids``."""
    fields = {
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": tuple(params.logit_bias or ()),
        "allowed_token_ids": params.allowed_token_ids or (),
    }
    for name, found in fields.items():
        bad = next((t for t in found if t >= vocab_size), None)
        if bad is not None:
            raise ParamError(name, f"{name}: {bad} is not a token id of this model ({_vocabulary(vocab_size)})")


def check_samples(params: SamplingParams, max_waiting: int | None) -> None:
    """Raise ``ParamError("n", ...)`` when ``params.n`` samples could never be admitted: more than
    ``max_waiting`` requests may not wait at once (each sample is one request)."""
    if max_waiting is not None and params.n > max_waiting:
        raise ParamError(
            "n",
            f"n={params.n} samples can never be admitted: at most max_waiting={max_waiting} requests may wait "
            f"(each sample is one request); lower n",
        )


def samples(request_id: str, params: SamplingParams) -> list[SampleSpec]:
    """The ``params.n`` samples of ``request_id`` (module docstring)."""
    prompt_only = params.prompt_logprobs is not None and params.max_tokens == 0
    out = []
    for j in range(params.n):
        sample = params.for_sample(j) if params.n > 1 else params
        if j > 0 and sample.prompt_logprobs is not None:  # one sample computes them for all
            sample = replace(sample, prompt_logprobs=None)
        engine_id = request_id if params.n == 1 else f"{request_id}#{j}"
        first_only = prompt_only and j == 0
        out.append(SampleSpec(engine_id, j, sample, 1 if first_only else sample.max_tokens, first_only))
    return out


def reject_detail(
    reason: m16.RejectReason,
    sample: SampleSpec,
    prompt_len: int,
    *,
    page_size: int,
    num_pages: int,
    max_model_len: int | None,
    configured_max_model_len: int | None,
    max_waiting: int | None,
) -> str:
    """The limit behind m12's refusal of ``sample`` (a prompt of ``prompt_len``), in words."""
    if reason is m16.RejectReason.EMPTY_PROMPT:
        return "the prompt has no tokens"
    max_tokens = sample.max_new_tokens
    if reason is m16.RejectReason.TOO_LONG:
        limit = (
            f"max_model_len {max_model_len}"
            if configured_max_model_len
            else f"the model's context of {max_model_len} positions"
        )
        extra = (
            " (prompt logprobs with max_tokens 0 compute one position past the prompt)" if sample.prompt_only else ""
        )
        return (
            f"a prompt of {prompt_len} token(s) + {max_tokens} new token(s) = {prompt_len + max_tokens}, "
            f"over {limit}{extra}"
        )
    if reason is m16.RejectReason.NEVER_FITS:
        need = m16.pages_for(prompt_len + max_tokens - 1, page_size)
        return f"needs {need} pages of {page_size} positions, the pool has {num_pages}"
    if reason is m16.RejectReason.OVERLOADED:
        return f"{max_waiting} request(s) already wait (max_waiting)"
    if reason is m16.RejectReason.DUPLICATE_ID:
        return "a request with this id is running"
    return str(reason.value)


class Grammars:
    """The engine's grammar compiler (``GrammarCompiler``), built on first use, safe from any thread:
    ``tokenizer`` (a Hugging Face tokenizer, or None), the model's ``vocab_size`` and ``world_size``;
    ``allow_additional_properties`` (``EngineConfig``'s) keeps JSON Schema's open objects (else an object
    that lists properties and says nothing of others is closed, as vLLM's default backend reads it)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, world_size: int = 1, *, allow_additional_properties: bool = False
    ) -> None:
        self.tokenizer, self.vocab_size, self.world_size = tokenizer, vocab_size, world_size
        self.allow_additional_properties = allow_additional_properties
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """``so`` compiled (cached by ``so.key``).  Raises ``ParamError("structured_outputs", ...)`` naming
        the problem (a schema keyword llguidance does not implement, a bad regex or grammar), or when this
        engine cannot constrain (no tokenizer, ``world_size > 1``)."""
        if self.world_size > 1:
            raise ParamError("structured_outputs", "structured outputs are not supported with world_size > 1 yet")
        if self.tokenizer is None or not hasattr(self.tokenizer, "backend_tokenizer"):
            raise ParamError(
                "structured_outputs", "structured outputs need the model's Hugging Face tokenizer; this one has none"
            )
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self.tokenizer, self.vocab_size, allow_additional_properties=self.allow_additional_properties
                )
            compiler = self._compiler
        return compiler.compile(so)


def _vocabulary(vocab_size: int) -> str:
    return f"vocabulary of {vocab_size}: 0..{vocab_size - 1}"


__all__ = [
    "Grammars",
    "SampleSpec",
    "check_ids",
    "check_samples",
    "checked_params",
    "prompt_ids",
    "reject_detail",
    "samples",
]
