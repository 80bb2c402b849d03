"""Prompt forms (``mechserve.entrypoints.prompts``): text that is not valid Unicode is refused naming its field,
``add_special_tokens`` reaches the tokenizer, the chat template's options reach the template."""

from __future__ import annotations

from typing import Any

import pytest

from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.llm import LLM
from mechserve.entrypoints.prompts import Chat, Text, encode_chat, parse_prompt


class BosTokenizer:
    """Words to ids, with a BOS (id 0) when asked for special tokens; a template that joins the contents."""

    chat_template = "x"

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        ids = [int(w[1:]) for w in text.split()]
        return type("Encoded", (), {"input_ids": [0, *ids] if add_special_tokens else ids})()

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool, **kw: Any) -> str:
        lead = "w9 " if kw.get("lead") else ""
        end = "" if kw.get("continue_final_message") else " w2"
        return lead + " ".join(m["content"] for m in messages) + end + (" w3" if add_generation_prompt else "")


def test_add_special_tokens_reaches_the_tokenizer() -> None:
    tok = BosTokenizer()
    assert parse_prompt("w5 w6", tok) == ("w5 w6", [0, 5, 6])
    assert parse_prompt(Text("w5 w6", add_special_tokens=False), tok) == ("w5 w6", [5, 6])
    messages = [{"role": "user", "content": "w5"}]
    assert encode_chat(tok, Chat(messages))[1] == [5, 2, 3]  # the template writes the special tokens
    assert encode_chat(tok, Chat(messages, add_special_tokens=True))[1] == [0, 5, 2, 3]


def test_the_templates_options_reach_it() -> None:
    tok = BosTokenizer()
    messages = [{"role": "user", "content": "w5"}]
    assert encode_chat(tok, Chat(messages, template_kwargs={"lead": True}))[1] == [9, 5, 2, 3]
    assert encode_chat(tok, Chat(messages, add_generation_prompt=False, continue_final_message=True))[1] == [5]
    with pytest.raises(ParamError) as err:
        encode_chat(tok, Chat(messages, continue_final_message=True))
    assert err.value.param == "continue_final_message"
    with pytest.raises(ParamError) as err:
        encode_chat(tok, Chat(messages, template_kwargs={"add_generation_prompt": False}))
    assert err.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("prompt", "param"), [("caf\ud800", "prompt"), (Chat([{"role": "user", "content": "\udce9"}]), "messages")]
)
def test_text_that_is_not_valid_unicode_names_its_field(prompt: Any, param: str) -> None:
    with pytest.raises(ParamError, match="not valid Unicode: a lone surrogate") as err:
        parse_prompt(prompt, BosTokenizer())
    assert err.value.param == param


def test_llm_generate_refuses_a_lone_surrogate_before_running_anything(tiny) -> None:
    llm = LLM(tiny, page_size=4, num_pages=32)
    with pytest.raises(ParamError, match="prompt is not valid Unicode"):
        llm.generate(["w1 w2", "w3\ud800"], SamplingParams(max_tokens=2), use_tqdm=False)
