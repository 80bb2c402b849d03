"""OpenAI's response and stream-chunk shapes, built from ``RequestOutput`` s and ``StreamEvent`` s.

Choice ``index`` is ``prompt_index * n + sample_index`` (OpenAI's order).
``usage`` counts are exact: ``prompt_tokens`` is the length of each prompt
as the model saw it (after the chat template), ``completion_tokens`` the
number of ids behind the returned text (an ending EOS or stop id included,
ids after a matched stop string not).  ``finish_reason`` is ``"stop"`` (EOS,
a stop id or a stop string), ``"length"``, or ``"abort"`` (the server shut
down under the request); ``stop_reason`` (vLLM's field) says which stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mechserve.api.outputs import RequestOutput, SampleDelta


def usage(prompt_lens: Iterable[int], outputs: Iterable[RequestOutput]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}


# Completions ---------------------------------------------------------------------------------------------------------


def completion_choices(
    outputs: Sequence[RequestOutput], n: int, token_text: Mapping[int, str], logprobs: bool
) -> list[dict[str, Any]]:
    return [
        {
            "index": i * n + c.index,
            "text": c.text,
            "logprobs": completion_logprobs(c.logprobs, token_text, 0) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for i, o in enumerate(outputs)
        for c in o.outputs
    ]


def completion_chunk_choice(
    prompt_index: int, n: int, d: SampleDelta, token_text: Mapping[int, str], offset: int | None
) -> dict[str, Any]:
    """One streamed completion choice; ``offset`` (with logprobs) is where this delta's text starts."""
    return {
        "index": prompt_index * n + d.index,
        "text": d.text,
        "logprobs": completion_logprobs(d.logprobs, token_text, offset) if offset is not None else None,
        "finish_reason": d.finish_reason if d.finished else None,
        "stop_reason": d.stop_reason if d.finished else None,
    }


def completion_logprobs(entries: Sequence[Any] | None, token_text: Mapping[int, str], offset: int) -> dict[str, Any]:
    """The legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for lp in entries or ():
        text = token_text.get(lp.token_id, "")
        tokens.append(text)
        logprobs.append(lp.logprob)
        top = {token_text.get(t, ""): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


# Chat ----------------------------------------------------------------------------------------------------------------


def chat_choices(output: RequestOutput, token_text: Mapping[int, str], logprobs: bool) -> list[dict[str, Any]]:
    return [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.logprobs, token_text) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in output.outputs
    ]


def chat_chunk_choice(d: SampleDelta, token_text: Mapping[int, str], logprobs: bool) -> dict[str, Any]:
    return {
        "index": d.index,
        "delta": {"content": d.text} if d.text else {},
        "logprobs": chat_logprobs(d.logprobs, token_text) if logprobs else None,
        "finish_reason": d.finish_reason if d.finished else None,
        "stop_reason": d.stop_reason if d.finished else None,
    }


def chat_role_choice(index: int) -> dict[str, Any]:
    """The first chunk of every choice: the assistant's role, no text yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def chat_logprobs(entries: Sequence[Any] | None, token_text: Mapping[int, str]) -> dict[str, Any]:
    """The chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text.get(token_id, "")
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
        for lp in entries or ()
    ]
    return {"content": content, "refusal": None}
