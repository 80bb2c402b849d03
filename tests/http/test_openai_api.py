"""The official openai client (sync and async) against the server on the tiny model: completions, chat,
streaming (SSE chunks, ``[DONE]``, ``include_usage``), stop strings, usage, ``n``, logprobs, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest
from server_support import TINY_NAME, random_prompts, words

from mechserve.entrypoints.prompts import apply_chat_template


def test_models_lists_the_served_model(tiny_server) -> None:
    client = tiny_server.client()
    (card,) = client.models.list().data
    assert card.id == TINY_NAME and card.owned_by == "mechserve"
    assert client.models.retrieve(TINY_NAME).id == TINY_NAME


def test_health_and_metrics(tiny_server) -> None:
    """/metrics in depth: tests/http/test_metrics.py."""
    tiny_server.client().completions.create(model=TINY_NAME, prompt="w1 w2", max_tokens=3, temperature=0)
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    response = httpx.get(tiny_server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = prometheus(response.text)
    assert samples["mechserve:kv_pages_total"] == 256
    assert samples["vllm:generation_tokens_total"] >= 3
    assert samples["vllm:time_to_first_token_seconds_count"] >= 1


def prometheus(text: str) -> dict[str, float]:
    """``name -> value`` of every sample labelled only with the model and engine (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if set(s.labels) == {"model_name", "engine"}
    }


# Completions -------------------------------------------------------------------------------------------------------


def test_completion_equals_the_request_run_alone_with_exact_usage(tiny_server, reference, tiny) -> None:
    prompt = random_prompts([7], seed=21)[0]
    out = tiny_server.client().completions.create(model=TINY_NAME, prompt=words(prompt), max_tokens=12, temperature=0)
    ref = reference(prompt, max_tokens=12).outputs[0]
    (choice,) = out.choices
    assert choice.text == ref.text and choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 12 and out.usage.total_tokens == 19
    assert tiny.tokenizer.decode(ref.token_ids) == choice.text.strip()
    assert out.object == "text_completion" and out.model == TINY_NAME and out.id.startswith("cmpl-")


def test_token_id_prompts_and_several_prompts_give_choices_in_order(tiny_server, reference) -> None:
    prompts = random_prompts([3, 9, 5], seed=4)
    out = tiny_server.client().completions.create(model=TINY_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        assert c.text == reference(prompts[c.index // 2], max_tokens=6).outputs[0].text
    assert out.usage.prompt_tokens == 3 + 9 + 5 and out.usage.completion_tokens == 6 * 6
    single = tiny_server.client().completions.create(model=TINY_NAME, prompt=prompts[1], max_tokens=4, temperature=0)
    assert single.choices[0].text == reference(prompts[1], max_tokens=4).outputs[0].text


def test_seeded_sampling_is_reproducible_and_n_samples_differ(tiny_server) -> None:
    client = tiny_server.client()
    ask = dict(model=TINY_NAME, prompt="w9 w8 w7", max_tokens=10, temperature=1.0, seed=123, n=3)
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1


def test_streamed_completion_adds_up_to_the_whole_one(tiny_server) -> None:
    client = tiny_server.client()
    ask = dict(model=TINY_NAME, prompt="w3 w1 w4 w1 w5", max_tokens=10, temperature=0)
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 5
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_the_event_stream_is_sse_ending_with_done(tiny_server) -> None:
    body = {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(block[6:]) for block in events[:-1]]
    assert "usage" not in chunks[0]  # only with stream_options.include_usage
    # one chunk per step, or fewer when the server was behind (waiting steps are merged)
    assert re.fullmatch(r"( w\d+){4}", "".join(c["choices"][0]["text"] for c in chunks))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_stop_strings_cut_the_text_and_never_stream_past_it(tiny_server, reference) -> None:
    prompt = random_prompts([6], seed=8)[0]
    full = reference(prompt, max_tokens=16).outputs[0].text
    stop = full.split()[4]  # the fifth word ends the text
    expected = reference(prompt, max_tokens=16, stop=[stop, "never there"]).outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    client = tiny_server.client()
    ask = dict(model=TINY_NAME, prompt=words(prompt), max_tokens=16, temperature=0, stop=[stop, "never there"])
    out = client.completions.create(**ask).choices[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected.text, "stop", stop)
    assert stop not in out.text
    streamed = [c.choices[0] for c in client.completions.create(**ask, stream=True)]
    assert "".join(c.text for c in streamed) == expected.text and streamed[-1].finish_reason == "stop"
    single = client.completions.create(**{**ask, "stop": stop}).choices[0]
    assert single.text == expected.text


def test_completion_logprobs(tiny_server, tiny) -> None:
    out = tiny_server.client().completions.create(
        model=TINY_NAME, prompt="w1 w2 w3", max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(f" {t}" for t in lp.tokens) == out.choices[0].text  # greedy: the chosen token is the top one
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and top[token] == max(top.values()) and len(top) == 2


def test_max_tokens_zero_returns_no_text(tiny_server) -> None:
    out = tiny_server.client().completions.create(model=TINY_NAME, prompt="w1", max_tokens=0)
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 0


# Chat --------------------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9 w10 w11"}]


def chat_prompt(tiny: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = apply_chat_template(tiny.tokenizer, messages, True, None)
    return list(tiny.tokenizer(text, add_special_tokens=False).input_ids)


def test_chat_uses_the_chat_template_with_exact_usage(tiny_server, tiny, reference) -> None:
    out = tiny_server.client().chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0
    )
    ids = chat_prompt(tiny, MESSAGES)
    ref = reference({"prompt_token_ids": ids}, max_tokens=8).outputs[0]
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 8
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


def test_chat_content_parts_and_the_developer_role(tiny_server, tiny, reference) -> None:
    parts = [{"type": "text", "text": "w9 "}, {"type": "text", "text": "w10 w11"}]
    out = tiny_server.client().chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "developer", "content": "w7 w8"}, {"role": "user", "content": parts}],
        max_tokens=5,
        temperature=0,
    )
    ref = reference({"prompt_token_ids": chat_prompt(tiny, MESSAGES)}, max_tokens=5).outputs[0]
    assert out.choices[0].message.content == ref.text


def test_chat_without_max_tokens_runs_to_the_context(tiny_server, tiny) -> None:
    out = tiny_server.client().chat.completions.create(model=TINY_NAME, messages=MESSAGES, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == 512  # the tiny model's context (max_position_embeddings)


def test_streamed_chat_starts_with_the_role_and_adds_up(tiny_server) -> None:
    client = tiny_server.client()
    ask = dict(model=TINY_NAME, messages=MESSAGES, max_tokens=6, temperature=0, n=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert [c.delta.role for c in chunks[0].choices] == ["assistant", "assistant"]
    for j in range(2):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert "".join(d.delta.content or "" for d in deltas) == whole.choices[j].message.content
        assert deltas[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].object == "chat.completion.chunk"


def test_chat_logprobs(tiny_server) -> None:
    out = tiny_server.client().chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token
        assert item.bytes == list(item.token.encode())


def test_the_async_client_streams_many_requests_at_once(tiny_server, reference) -> None:
    prompts = random_prompts([4, 11, 2, 17, 8, 6, 13, 5], seed=9)

    async def one(client: Any, prompt: list[int]) -> str:
        stream = await client.completions.create(
            model=TINY_NAME, prompt=words(prompt), max_tokens=9, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        async with tiny_server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [reference(p, max_tokens=9).outputs[0].text for p in prompts]
    counts = tiny_server.wait_idle()
    assert counts["private"] == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_extensions_pass_through_extra_body(tiny_server, endpoint: str) -> None:
    client = tiny_server.client()
    extra = {"min_tokens": 3, "top_k": 1, "stop_token_ids": [], "ignore_eos": True}
    if endpoint == "chat":
        out = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=3, extra_body=extra)
        assert out.usage.completion_tokens == 3
    else:
        out = client.completions.create(model=TINY_NAME, prompt="w1", max_tokens=3, extra_body=extra)
        assert out.usage.completion_tokens == 3
