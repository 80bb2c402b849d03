"""Helpers of the serving tests: the tiny model's words, a served ``AsyncLLM``, waiting for an idle engine.

A module of its own (not ``conftest``) so that test modules can import it by a name no other test folder uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mechserve.async_llm import AsyncLLM

VOCAB = 128
TINY_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def tiny_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 Llama config; large init so greedy choices are not near ties."""
    from transformers import AutoConfig

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return AutoConfig.for_model("llama", **fields)


def words(ids: Sequence[int]) -> str:
    """The tiny tokenizer's text for ``ids`` (``w3 w14 ...``)."""
    return " ".join(f"w{i}" for i in ids)


def random_prompts(lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


class Served:
    """A running server (``BackgroundServer``) over ``llm``; ``client()`` / ``async_client()`` are openai clients."""

    def __init__(self, server: Any, llm: AsyncLLM, api_key: str = "none") -> None:
        self.server = server
        self.llm = llm
        self.url = server.url
        self.api_key = api_key

    def client(self, **options: Any) -> Any:
        import openai

        options.setdefault("api_key", self.api_key)
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **options)

    def async_client(self, **options: Any) -> Any:
        import openai

        options.setdefault("api_key", self.api_key)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **options)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, int]:
        """Wait until no request is left in the engine; check the pool; return its page counts."""
        return wait_idle(self.llm, timeout)


def wait_idle(llm: AsyncLLM, timeout: float = 20.0) -> dict[str, int]:
    """Poll the engine (between steps) until it holds no request; then ``check_pages``; return the counts.
    (After shutdown the core is checked directly: nothing else touches it any more.)"""
    if not llm.running:
        llm.core.check_pages()
        return llm.core.page_counts()
    deadline = time.monotonic() + timeout
    while llm.call_in_engine(lambda core: core.has_unfinished() or bool(core.engine.live)).result(timeout):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.01)
    llm.call_in_engine(lambda core: core.check_pages()).result(timeout)
    return llm.call_in_engine(lambda core: core.page_counts()).result(timeout)


@contextmanager
def serving(llm: AsyncLLM, **app_options: Any) -> Iterator[Served]:
    """``llm`` behind a uvicorn server on 127.0.0.1 and a free port, for the ``with`` block."""
    from mechserve.server import BackgroundServer, build_app

    with BackgroundServer(build_app(llm, **app_options)) as server:
        yield Served(server, llm, app_options.get("api_key") or "none")
