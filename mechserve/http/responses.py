"""OpenAI's response and stream-chunk shapes, built from ``RequestOutput`` s and ``StreamEvent`` s.

Choice ``index`` is ``prompt_index * n + sample_index`` (OpenAI's order).
``usage`` counts are exact: ``prompt_tokens`` is the length of each prompt
as the model saw it (after the chat template), ``completion_tokens`` the
number of ids behind the returned text (an ending EOS or stop id included,
ids after a matched stop string not).  ``finish_reason`` is ``"stop"`` (EOS,
a stop id or a stop string), ``"length"``, or ``"abort"`` (the server shut
down under the request) or ``"tool_calls"`` (a reply with tool calls, ``mechserve.entrypoints.tools``);
``stop_reason`` (vLLM's field) says which stop.

Logprobs come from the engine in vLLM's shape (one ``dict[int, Logprob]`` per token, the chosen or
prompt token first, each with its ``decoded_token``) and leave in OpenAI's: completions'
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` (with ``echo``, the prompt's
tokens first, the first one's logprob null), chat's ``content`` list; ``prompt_logprobs`` keeps
vLLM's shape (``{"<id>": {"logprob", "rank", "decoded_token"}}`` per position, null first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.api.outputs import CompletionOutput, PositionLogprobs, RequestOutput, SampleDelta
from mechserve.entrypoints.tools import ToolPlan, ToolStream, finish_reason


@dataclass(frozen=True, slots=True)
class Render:
    """How one response shows its choices: ``logprobs`` (OpenAI's), ``echo`` (the prompt first),
    ``prompt_logprobs`` (vLLM's field), ``token_ids`` (vLLM's ``return_token_ids``), ``ids_as_tokens``
    (vLLM's ``return_tokens_as_token_ids``); ``top_n``: the alternatives asked for; ``decode`` turns ids
    into text (the echoed prompt of token ids, and the first prompt token, which has no logprobs)."""

    logprobs: bool = False
    echo: bool = False
    prompt_logprobs: bool = False
    token_ids: bool = False
    ids_as_tokens: bool = False
    top_n: int = 0
    decode: Callable[[Sequence[int]], str] = lambda ids: ""

    def token(self, token_id: int, entry: PositionLogprobs | None) -> str:
        """The text OpenAI's logprobs show for ``token_id`` (``entry``: its position's logprobs, if any)."""
        if self.ids_as_tokens:
            return f"token_id:{token_id}"
        found = entry.get(token_id) if entry is not None else None
        if found is not None and found.decoded_token is not None:
            return found.decoded_token
        return self.decode([token_id])


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a choice echoes of its prompt: its ``text``, ``token_ids`` and their logprobs (vLLM's shape)."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[PositionLogprobs | None] | None = None


def usage(prompt_lens: Iterable[int], outputs: Iterable[RequestOutput]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}


def vllm_prompt_logprobs(entries: Sequence[PositionLogprobs | None] | None) -> list[Any] | None:
    """``RequestOutput.prompt_logprobs`` as JSON, vLLM's shape: null first, then ``{"<id>": {...}}``."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in e.items()
        }
        for e in entries
    ]


# Completions ---------------------------------------------------------------------------------------------------------


def completion_choices(
    outputs: Sequence[RequestOutput], prompts: Sequence[Prompt], n: int, render: Render
) -> list[dict[str, Any]]:
    """Every choice of a completions response, prompt by prompt (``prompts[i]`` is output ``i``'s prompt)."""
    return [
        completion_choice(
            i * n + c.index,
            c,
            render,
            echo=prompt if render.echo else None,
            prompt_ids=prompt.token_ids,
            prompt_logprobs=o.prompt_logprobs,
        )
        for i, (o, prompt) in enumerate(zip(outputs, prompts))
        for c in o.outputs
    ]


def completion_choice(
    index: int,
    c: CompletionOutput | SampleDelta,
    render: Render,
    *,
    echo: Prompt | None = None,
    prompt_ids: Sequence[int] | None = None,
    offset: int = 0,
    prompt_logprobs: Sequence[PositionLogprobs | None] | None = None,
) -> dict[str, Any]:
    """One completions choice (or streamed chunk choice) of ``c``: ``echo``, what to show before its text
    (the prompt, with its logprobs); ``prompt_ids`` for ``render.token_ids`` (a stream's first chunk);
    ``offset``: where ``c``'s text starts in the choice's text so far (for ``text_offset``)."""
    finished = c.finish_reason is not None
    text = c.text
    entries: list[tuple[int, PositionLogprobs | None]] = []
    if echo is not None:
        text = echo.text + text
        if render.logprobs:
            entries += zip(echo.token_ids, echo.logprobs or [None] * len(echo.token_ids))
    if render.logprobs:
        entries += zip(c.token_ids, c.logprobs or ())
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(entries, render, offset) if render.logprobs else None,
        "finish_reason": c.finish_reason if finished else None,
        "stop_reason": c.stop_reason if finished else None,
    }
    if render.prompt_logprobs and prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs)
    if render.token_ids:
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(c.token_ids)
    return choice


def completion_logprobs(
    entries: Sequence[tuple[int, PositionLogprobs | None]], render: Render, offset: int
) -> dict[str, Any]:
    """The legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``;
    a position without logprobs (the first prompt token) has null ones."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in entries:
        text = render.token(token_id, entry)
        tokens.append(text)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
        else:
            logprobs.append(entry[token_id].logprob)
            tops.append({render.token(t, entry): lp.logprob for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


# Chat ----------------------------------------------------------------------------------------------------------------


def chat_choices(output: RequestOutput, render: Render, tools: ToolPlan | None = None) -> list[dict[str, Any]]:
    """Every choice of a chat response; with ``tools`` (an active plan), each reply parsed for tool calls."""
    choices = []
    for c in output.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if tools is not None and tools.active:
            reply = ToolStream(tools).parse(c.text)
            message, finish = reply.message(), finish_reason(c.finish_reason, bool(reply.calls))
        choice = {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, render) if render.logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }
        if render.token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    return choices


def chat_chunk_choice(
    d: SampleDelta, render: Render, delta: dict[str, Any] | None = None, finish: str | None = None
) -> dict[str, Any]:
    """One streamed chat choice of ``d``; ``delta`` and ``finish`` replace its text and finish reason (a reply
    parsed for tool calls)."""
    choice: dict[str, Any] = {
        "index": d.index,
        "delta": delta if delta is not None else {"content": d.text} if d.text else {},
        "logprobs": chat_logprobs(d.token_ids, d.logprobs, render) if render.logprobs else None,
        "finish_reason": (finish or d.finish_reason) if d.finished else None,
        "stop_reason": d.stop_reason if d.finished else None,
    }
    if render.token_ids:
        choice["token_ids"] = list(d.token_ids)
    return choice


def chat_finish_choice(d: SampleDelta, render: Render, finish: str | None) -> dict[str, Any]:
    """A streamed choice's own last chunk: an empty delta with the finish reason (``finish``, else ``d``'s)."""
    choice: dict[str, Any] = {
        "index": d.index,
        "delta": {},
        "logprobs": None,
        "finish_reason": finish or d.finish_reason,
        "stop_reason": d.stop_reason,
    }
    if render.token_ids:
        choice["token_ids"] = []
    return choice


def chat_role_choice(index: int) -> dict[str, Any]:
    """The first chunk of every choice: the assistant's role, no text yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[PositionLogprobs] | None, render: Render
) -> dict[str, Any]:
    """The chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``, with the
    ``render.top_n`` most likely alternatives (the chosen token among them only if it is one of them)."""

    def item(token_id: int, entry: PositionLogprobs) -> dict[str, Any]:
        text = render.token(token_id, entry)
        return {"token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries or ()):
        # vLLM's shape holds the chosen id first and the top N after it, the chosen id once: N entries
        # when it is one of the top N, else N + 1
        top = _by_rank(entry) if render.top_n and len(entry) == render.top_n else [t for t in entry if t != token_id]
        content.append({**item(token_id, entry), "top_logprobs": [item(t, entry) for t in top[: render.top_n]]})
    return {"content": content, "refusal": None}


def _by_rank(entry: PositionLogprobs) -> list[int]:
    return sorted(entry, key=lambda t: entry[t].rank or 0)
