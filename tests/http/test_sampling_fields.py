"""Penalties, token filters, prompt logprobs, echo and the template options through the server, each with an effect
a client can see; and the field-level defects of the trial (lone surrogates, a request that can never be admitted,
a body over the cap), each fixed for its kind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_support import TINY_NAME, serving

from mechserve.http.protocol import ChatCompletionRequest, CompletionRequest
from mechserve.model.loader import load_model

REPEATING = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"
CHAT = [{"role": "user", "content": REPEATING}]


def completion(served: Any, **body: Any) -> dict[str, Any]:
    response = httpx.post(served.url + "/v1/completions", json={"model": TINY_NAME, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def chat(served: Any, **body: Any) -> dict[str, Any]:
    response = httpx.post(served.url + "/v1/chat/completions", json={"model": TINY_NAME, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def raw(served: Any, path: str, content: str) -> httpx.Response:
    """POST ``content`` as it is (JSON escapes such as ``\\ud800`` reach the server untouched)."""
    return httpx.post(served.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def words_of(text: str) -> list[str]:
    return text.split()


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


# Penalties and filters have an effect -------------------------------------------------------------------------------


def test_repetition_penalty_changes_the_greedy_text_and_matches_the_library(tiny_server, reference) -> None:
    plain = completion(tiny_server, prompt=REPEATING, max_tokens=10, temperature=0)["choices"][0]["text"]
    penalized = completion(tiny_server, prompt=REPEATING, max_tokens=10, temperature=0, repetition_penalty=3.0)
    text = penalized["choices"][0]["text"]
    assert text != plain
    assert text == reference(REPEATING, max_tokens=10, repetition_penalty=3.0).outputs[0].text
    reply = chat(tiny_server, messages=CHAT, max_tokens=10, temperature=0, repetition_penalty=1e-3)
    # below 1 the penalty favours what the prompt holds: the reply copies the prompt's words
    assert set(words_of(reply["choices"][0]["message"]["content"])) <= set(words_of(REPEATING)) | {"w1", "w2", "w3"}


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
def test_output_penalties_change_a_text_that_repeats_itself(tiny_server, reference, field: str) -> None:
    plain = completion(tiny_server, prompt="w3", max_tokens=40, temperature=0)["choices"][0]["text"]
    assert len(set(words_of(plain))) < len(words_of(plain))  # the tiny model repeats itself here
    got = completion(tiny_server, prompt="w3", max_tokens=40, temperature=0, **{field: 2.0})["choices"][0]["text"]
    assert got != plain and got == reference("w3", max_tokens=40, **{field: 2.0}).outputs[0].text
    assert len(set(words_of(got))) > len(set(words_of(plain)))


def test_logit_bias_forces_or_bans_a_token(tiny_server) -> None:
    forced = completion(tiny_server, prompt="w1 w2", max_tokens=6, temperature=0.8, seed=1, logit_bias={"42": 100})
    assert words_of(forced["choices"][0]["text"]) == ["w42"] * 6
    reply = chat(tiny_server, messages=CHAT, max_tokens=4, temperature=0, logit_bias={"17": 100})
    assert words_of(reply["choices"][0]["message"]["content"]) == ["w17"] * 4
    plain = completion(tiny_server, prompt=REPEATING, max_tokens=8, temperature=0)["choices"][0]["text"]
    first = words_of(plain)[0][1:]
    banned = completion(tiny_server, prompt=REPEATING, max_tokens=8, temperature=0, logit_bias={first: -100})
    assert f"w{first}" not in words_of(banned["choices"][0]["text"])


def test_bad_words_never_appear_and_allowed_ids_are_all_that_appear(tiny_server) -> None:
    plain = words_of(completion(tiny_server, prompt=REPEATING, max_tokens=12, temperature=0)["choices"][0]["text"])
    bad = sorted(set(plain))[:3]
    got = words_of(
        completion(tiny_server, prompt=REPEATING, max_tokens=12, temperature=0, bad_words=bad)["choices"][0]["text"]
    )
    assert got != plain and not set(got) & set(bad)
    reply = chat(tiny_server, messages=CHAT, max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=[7, 9])
    assert set(words_of(reply["choices"][0]["message"]["content"])) <= {"w7", "w9"}


# Prompt logprobs and echo: the log-likelihood path of evaluation harnesses -------------------------------------------


def lm_eval_loglikelihood(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs`` (0.4.x), as it reads the response."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(token_logprobs), all(t == max(top.values()) for t, top in zip(token_logprobs, tops))))
    return res


def test_lm_evals_loglikelihood_request_scores_continuations_as_transformers(tiny_server, hf) -> None:
    """lm-eval's ``local-completions`` sends ``echo, logprobs: 1, max_tokens: 1`` over token ids, in batches."""
    contexts, continuations = [[5, 6, 7, 8, 5, 6], [9, 10, 11]], [[7, 8], [12]]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    out = completion(tiny_server, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    got = lm_eval_loglikelihood(out, [len(c) for c in contexts])
    for prompt, ctx, (score, greedy) in zip(prompts, contexts, got):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        want = sum(float(lp[p - 1, prompt[p]]) for p in range(len(ctx), len(prompt)))
        assert abs(score - want) < 1e-4
        assert greedy == all(int(lp[p - 1].argmax()) == prompt[p] for p in range(len(ctx), len(prompt)))
    for choice, prompt in zip(out["choices"], prompts):
        lps = choice["logprobs"]
        assert (
            len(lps["tokens"]) == len(prompt) + 1
            and lps["token_logprobs"][0] is None
            and lps["top_logprobs"][0] is None
        )
        assert lps["tokens"][: len(prompt)] == [f"w{t}" for t in prompt]
        assert words_of(choice["text"])[: len(prompt)] == [f"w{t}" for t in prompt]


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(tiny_server, hf) -> None:
    text = "w5 w6 w7 w8 w9"
    out = completion(tiny_server, prompt=text, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    ids = [5, 6, 7, 8, 9]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and all(abs(got[p] - float(lp[p - 1, ids[p]])) < 1e-4 for p in range(1, 5))
    assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"][1:])
    plain = completion(tiny_server, prompt=text, echo=True, max_tokens=2)["choices"][0]
    assert plain["text"].startswith(text) and plain["logprobs"] is None


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(tiny_server, hf) -> None:
    ids = [5, 6, 7, 8]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    (choice,) = completion(tiny_server, prompt=ids, prompt_logprobs=1, max_tokens=1)["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    for p in range(1, 4):
        first = next(iter(entries[p]))
        assert first == str(ids[p]) and len(entries[p]) in (1, 2)
        assert abs(entries[p][first]["logprob"] - float(lp[p - 1, ids[p]])) < 1e-4
        assert entries[p][first]["decoded_token"] == f"w{ids[p]}" and entries[p][first]["rank"] >= 1
    reply = chat(tiny_server, messages=[{"role": "user", "content": "w5"}], max_tokens=1, prompt_logprobs=0)
    assert reply["prompt_logprobs"][0] is None and all(len(e) == 1 for e in reply["prompt_logprobs"][1:])
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]


def test_streamed_echo_starts_with_the_prompt(tiny_server) -> None:
    body = {"model": TINY_NAME, "prompt": "w5 w6", "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    chunks = []
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert text.startswith("w5 w6 ") and len(words_of(text)) == 5 and tokens[:2] == ["w5", "w6"] and len(tokens) == 5
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None


# The cheap request options --------------------------------------------------------------------------------------------


def test_truncation_token_ids_and_request_ids(tiny_server) -> None:
    out = completion(
        tiny_server,
        prompt="w1 w2 w3 w4 w5",
        truncate_prompt_tokens=3,
        max_tokens=2,
        return_token_ids=True,
        request_id="eval-7",
    )
    (choice,) = out["choices"]
    assert out["id"] == "cmpl-eval-7" and out["usage"]["prompt_tokens"] == 3
    assert choice["prompt_token_ids"] == [3, 4, 5] and len(choice["token_ids"]) == 2
    ids = completion(tiny_server, prompt="w1 w2", max_tokens=2, logprobs=0, return_tokens_as_token_ids=True)
    tokens = ids["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == 2
    assert completion(tiny_server, prompt="w1", n_predict=3)["usage"]["completion_tokens"] == 3
    refused = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "w1", "n_predict": 3, "max_tokens": 2})
    assert error(refused)["param"] == "n_predict"


def test_continue_final_message_and_add_generation_prompt_shape_the_prompt(tiny_server) -> None:
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    opened = chat(tiny_server, messages=messages, max_tokens=1, return_token_ids=True)
    assert opened["prompt_token_ids"] == [1, 5, 2, 1, 6, 7, 2, 3]  # the template: w1 .. w2 per message, then w3
    closed = chat(tiny_server, messages=messages, max_tokens=1, return_token_ids=True, add_generation_prompt=False)
    assert closed["prompt_token_ids"] == [1, 5, 2, 1, 6, 7, 2]
    cont = chat(
        tiny_server,
        messages=messages,
        max_tokens=1,
        return_token_ids=True,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont["prompt_token_ids"] == [1, 5, 2, 1, 6, 7]  # the assistant's message left open


@pytest.fixture(scope="module")
def templated(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server whose chat template reads a variable, ``lead``, from chat_template_kwargs."""
    from transformers import AutoTokenizer

    from mechserve.entrypoints.async_llm import AsyncLLM

    path = tmp_path_factory.mktemp("templated")
    for f in tiny_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and "tokenizer" not in f.name:
            shutil.copy(f, path / f.name)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = "{% if lead %}w9 {% endif %}{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
    tok.save_pretrained(path)
    with serving(AsyncLLM(load_model(str(path)), page_size=4, num_pages=64, model_name=TINY_NAME)) as served:
        yield served


def test_chat_template_kwargs_reach_the_template(templated) -> None:
    messages = [{"role": "user", "content": "w5"}]
    plain = chat(templated, messages=messages, max_tokens=1, return_token_ids=True)
    led = chat(templated, messages=messages, max_tokens=1, return_token_ids=True, chat_template_kwargs={"lead": True})
    assert plain["prompt_token_ids"] == [1, 5, 2, 3] and led["prompt_token_ids"] == [9, 1, 5, 2, 3]


def test_the_body_translates_to_the_libraries_options() -> None:
    body = CompletionRequest.model_validate({"prompt": ["w1", "w2"], "seed": -1, "add_special_tokens": False})
    (first, _), params = body.prompts(), body.to_params()
    assert first.add_special_tokens is False and params.seed is None  # -1: unseeded (vLLM's, llama.cpp's rule)
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    echo = CompletionRequest.model_validate({"prompt": "w1", "echo": True, "logprobs": 2}).to_params()
    assert echo.prompt_logprobs == 2 and echo.logprobs == 2
    conversation = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "w1"}], "add_special_tokens": True, "chat_template_kwargs": {"a": 1}}
    ).chat()
    assert conversation.add_special_tokens and conversation.template_kwargs == {"a": 1}


# The trial's field-level defects, each fixed for its kind -------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        ("/v1/completions", '{"prompt": "caf\\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["w1", "\\udce9"], "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": "w1", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
        ("/v1/completions", '{"prompt": "w1", "bad_words": ["\\udfff"], "max_tokens": 1}', "bad_words"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}], "max_tokens": 1}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(tiny_server, path: str, content: str, param: str) -> None:
    found = error(raw(tiny_server, path, content))
    assert found["param"] == param and "not valid Unicode" in found["message"] and "surrogate" in found["message"]
    assert completion(tiny_server, prompt="w1", max_tokens=1)["usage"]["completion_tokens"] == 1


def test_a_request_that_can_never_be_admitted_is_400_not_429(make_llm) -> None:
    with serving(make_llm(max_waiting=2)) as served:
        url = served.url + "/v1/completions"
        found = error(httpx.post(url, json={"prompt": "w1", "n": 3, "max_tokens": 1}))
        assert found["param"] == "n" and "max_waiting" in found["message"]
        found = error(httpx.post(url, json={"prompt": ["w1", "w2"], "n": 2, "max_tokens": 1}))
        assert found["param"] == "n" and "never" in found["message"]
        chat_url = served.url + "/v1/chat/completions"
        assert error(httpx.post(chat_url, json={"messages": CHAT, "n": 3, "max_tokens": 1}))["param"] == "n"
        assert httpx.post(url, json={"prompt": "w1", "n": 2, "max_tokens": 1}).status_code == 200


def test_a_body_over_the_cap_is_413_before_it_is_read(make_llm) -> None:
    with serving(make_llm(), max_request_bytes=2000) as served:
        url = served.url + "/v1/completions"
        big = json.dumps({"prompt": "w1 " * 1000, "max_tokens": 1})
        assert error(httpx.post(url, content=big, headers={"content-type": "application/json"}), 413)["code"] == (
            "body_too_large"
        )

        def chunked(text: str) -> Iterator[bytes]:  # no Content-Length: the cap counts what arrives
            for i in range(0, len(text), 500):
                yield text[i : i + 500].encode()

        found = error(httpx.post(url, content=chunked(big), headers={"content-type": "application/json"}), 413)
        assert "2000 bytes" in found["message"]
        small = json.dumps({"prompt": "w1 w2", "max_tokens": 2})
        ok = httpx.post(url, content=chunked(small), headers={"content-type": "application/json"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        (
            [{"role": "user", "content": "w1"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}],
            "messages.1.tool_calls.0.type",
            "Field required",
        ),
        (
            [{"role": "user", "content": "w1"}, {"role": "tool", "content": "w2"}],
            "messages.1",
            "tool_call_id",
        ),
        (
            [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2", "function_call": {"name": "f"}}],
            "messages.1.function_call",
            "not supported",
        ),
        (
            [
                {"role": "user", "content": "w1"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            "messages.1.tool_calls.0.function.arguments",
            "JSON text of an object",
        ),
        (  # the tiny model's template renders no tools and is not ChatML: refused, not dropped
            [{"role": "user", "content": "w1"}, {"role": "tool", "content": "w2", "tool_call_id": "c1"}],
            "messages",
            "renders no tools",
        ),
    ],
)
def test_bad_or_unrenderable_tool_history_is_refused_not_dropped(
    tiny_server, messages: list, param: str, words: str
) -> None:
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    found = error(response)
    assert found["param"] == param and words in found["message"], found
    history = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2", "tool_calls": []}]
    assert chat(tiny_server, messages=history, max_tokens=1)["usage"]["completion_tokens"] == 1
