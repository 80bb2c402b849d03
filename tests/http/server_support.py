"""Helpers of the serving tests: the tiny model's words, a served ``AsyncLLM``, waiting for an idle engine.

A module of its own (not ``conftest``) so that test modules can import it by a name no other test folder uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tiny_models import CHAT_TEMPLATE, VOCAB, random_prompts, tiny_config, words

from mechserve.entrypoints.async_llm import AsyncLLM

__all__ = [
    "CHAT_TEMPLATE",
    "TINY_NAME",
    "VOCAB",
    "Served",
    "plant_matcher_failure",
    "random_prompts",
    "serving",
    "tiny_config",
    "wait_idle",
    "words",
]

TINY_NAME = "tiny"


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
        return page_counts(llm.core)
    deadline = time.monotonic() + timeout
    while llm.call_in_engine(lambda core: core.has_unfinished() or core.scheduler.has_live()).result(timeout):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.01)
    llm.call_in_engine(lambda core: core.check_pages()).result(timeout)
    return llm.call_in_engine(page_counts).result(timeout)


def page_counts(core: Any) -> dict[str, int]:
    """``{"free", "cached", "private"}`` pages of ``core``'s pool (``EngineCore.stats``)."""
    pages = core.stats().pages
    return {"free": pages.free, "cached": pages.cached, "private": pages.private}


@contextmanager
def serving(llm: AsyncLLM, **app_options: Any) -> Iterator[Served]:
    """``llm`` behind a uvicorn server on 127.0.0.1 and a free port, for the ``with`` block."""
    from mechserve.http import BackgroundServer, build_app

    with BackgroundServer(build_app(llm, **app_options)) as server:
        yield Served(server, llm, app_options.get("api_key") or "none")


def plant_matcher_failure(monkeypatch: Any) -> None:
    """A grammar that compiles but fails inside a step (issue 31): the matcher of any constraint whose key
    names ``planted`` raises on its third mask, with a long dump that must not reach the client or the log."""
    from mechserve.executor.structured import GrammarMatcher

    original = GrammarMatcher.window_masks

    def third_mask_fails(self: GrammarMatcher, *args: Any) -> int:
        if "planted" in self.grammar.key[1]:
            self.planted = getattr(self, "planted", 0) + 1  # type: ignore[attr-defined]
            if self.planted == 3:  # type: ignore[attr-defined]
                raise ValueError("planted matcher failure\n" + "grammar dump " * 500)
        return original(self, *args)

    monkeypatch.setattr(GrammarMatcher, "window_masks", third_mask_fails)
