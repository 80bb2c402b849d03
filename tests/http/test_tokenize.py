"""``/tokenize``, ``/detokenize`` and ``/version`` with vLLM's request and response shapes (httpx on the tiny model).

The ids ``/tokenize`` returns are the ids the engine runs for the same prompt: a completion's and a
chat's ``usage.prompt_tokens`` count them, and ``LLM.generate`` reports them as ``prompt_token_ids``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_support import CHAT_TEMPLATE, TINY_NAME, Served, random_prompts, serving, words

from mechserve import __version__
from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import LoadedModel

CHAT = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6 w7"}]


def post(served: Any, path: str, body: Any) -> httpx.Response:
    """``body`` as JSON with non-ASCII escaped, so that a lone surrogate travels as ``\\ud800`` (as a client sends it)."""
    return httpx.post(
        served.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=30
    )


def test_text_is_tokenized_as_the_engine_runs_it(tiny_server, reference) -> None:
    prompt = random_prompts([9], seed=3)[0]
    reply = post(tiny_server, "/tokenize", {"model": TINY_NAME, "prompt": words(prompt)})
    assert reply.status_code == 200
    body = reply.json()
    assert body == {"count": 9, "max_model_len": 512, "tokens": prompt, "token_strs": None}
    assert body["tokens"] == reference(words(prompt), max_tokens=1).prompt_token_ids
    out = tiny_server.client().completions.create(model=TINY_NAME, prompt=words(prompt), max_tokens=1)
    assert out.usage.prompt_tokens == body["count"]


def test_token_strings_and_special_tokens(tiny_server, tiny) -> None:
    body = post(tiny_server, "/tokenize", {"prompt": "w1 w2", "return_token_strs": True}).json()
    assert body["tokens"] == [1, 2] and body["token_strs"] == ["w1", "w2"]
    # The word tokenizer adds no BOS: add_special_tokens changes nothing for it, but it is honoured (not refused).
    assert post(tiny_server, "/tokenize", {"prompt": "w1 w2", "add_special_tokens": False}).json()["tokens"] == [1, 2]


def test_a_conversation_is_tokenized_through_the_chat_template(tiny_server, tiny) -> None:
    body = post(tiny_server, "/tokenize", {"model": TINY_NAME, "messages": CHAT}).json()
    text = tiny.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tiny.tokenizer(text, add_special_tokens=False).input_ids
    reply = tiny_server.client().chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=1)
    assert reply.usage.prompt_tokens == body["count"]
    without = post(tiny_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["tokens"] == body["tokens"][: without["count"]] and without["count"] < body["count"]


@pytest.fixture(scope="module")
def trusting_server(tiny: LoadedModel) -> Iterator[Served]:
    """A server that renders chat templates sent with requests (``--trust-request-chat-template``)."""
    llm = AsyncLLM(tiny, page_size=4, num_pages=64, model_name=TINY_NAME)
    with serving(llm, trust_request_chat_template=True) as served:
        yield served


REQUEST_TEMPLATE = (
    "{% for m in messages %}w100 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w101{% endif %}"
)


def test_a_requests_chat_template_is_refused_unless_the_server_trusts_them(tiny_server) -> None:
    """vLLM's rule: a template in the request is a 400 naming it and the flag; nothing is rendered."""
    for path, body in [
        ("/tokenize", {"messages": CHAT, "chat_template": REQUEST_TEMPLATE}),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template": REQUEST_TEMPLATE, "max_tokens": 1}),
    ]:
        reply = post(tiny_server, path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


def test_a_requests_chat_template_replaces_the_models(trusting_server) -> None:
    body = post(trusting_server, "/tokenize", {"messages": CHAT, "chat_template": REQUEST_TEMPLATE}).json()
    assert body["tokens"] == [100, 9, 100, 5, 6, 7, 101]
    assert REQUEST_TEMPLATE != CHAT_TEMPLATE
    reply = post(
        trusting_server,
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template": REQUEST_TEMPLATE, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert reply["prompt_token_ids"] == body["tokens"]


def test_the_template_options_are_those_of_chat_completions(trusting_server) -> None:
    """``chat_template_kwargs`` and ``continue_final_message`` (without a generation prompt) reach the template as
    they do on ``/v1/chat/completions``: the count is the prompt's ``usage``."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ tail }}"
    body = {"messages": CHAT, "chat_template": template, "chat_template_kwargs": {"tail": "w3"}}
    assert post(trusting_server, "/tokenize", body).json()["tokens"] == [9, 5, 6, 7, 3]
    open_turn = {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}
    ids = post(trusting_server, "/tokenize", open_turn).json()["tokens"]
    reply = trusting_server.client().chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_tokens=1, extra_body={k: v for k, v in open_turn.items() if k != "messages"}
    )
    assert reply.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("template", "bound"),
    [
        ("{{ raise_exception('no') }}", "cannot render these messages: no"),
        ("{{ 'ab ' * 3000000 }}", "renders to more than"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "MiB"),
    ],
    ids=["raises", "huge-output", "endless-loops", "exponential-memory"],
)
def test_a_trusted_template_is_still_bounded_in_time_memory_and_output(trusting_server, template, bound) -> None:
    """A hostile template on a trusting server: a 400 naming ``chat_template`` and the bound it met, and the
    server goes on (the render ran in a child process, which a timeout kills)."""
    reply = post(trusting_server, "/tokenize", {"messages": CHAT, "chat_template": template})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "chat_template" and bound in error["message"], error
    assert post(trusting_server, "/tokenize", {"messages": CHAT, "chat_template": "{{ 'w3' }}"}).json()["tokens"] == [3]


def test_detokenize_is_the_inverse(tiny_server) -> None:
    ids = post(tiny_server, "/tokenize", {"prompt": "w3 w1 w4 w1 w5"}).json()["tokens"]
    reply = post(tiny_server, "/detokenize", {"model": TINY_NAME, "tokens": ids})
    assert reply.status_code == 200 and reply.json() == {"prompt": "w3 w1 w4 w1 w5"}
    assert post(tiny_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version(tiny_server) -> None:
    reply = httpx.get(tiny_server.url + "/version")
    assert reply.status_code == 200 and reply.json() == {"version": __version__}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "w1", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages.0"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ raise_exception('no') }}"}, 400, "chat_template"),
        ("/tokenize", {"prompt": "w1", "model": "other"}, 404, None),
        ("/tokenize", [1, 2], 400, None),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 128]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "w1"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, None),
    ],
)
def test_bad_input_is_an_error_naming_the_field(tiny_server, path: str, body: Any, status: int, param: Any) -> None:
    reply = post(tiny_server, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
