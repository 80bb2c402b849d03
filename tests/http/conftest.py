"""Fixtures for the serving tests: a tiny random Llama with a word tokenizer, served by ``AsyncLLM`` and uvicorn.

The tiny model's tokenizer has the words ``w0`` .. ``w127`` (id = number, no
BOS, no EOS: every request runs to ``max_tokens``) and a chat template, so
the server's text, chat and token-id paths all run in milliseconds.  Every
server binds a socket on 127.0.0.1 port 0 (the kernel picks a free port).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from server_support import TINY_NAME, Served, serving
from tiny_models import save_tiny, save_word_tokenizer, tiny_config

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama with a word-level tokenizer (``w0`` .. ``w127``) and a chat template."""
    path = tmp_path_factory.mktemp("tiny-server")
    save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    """The tiny model, loaded once."""
    return load_model(str(tiny_dir))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the engine thread, the server and the clients share two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_llm(tiny: LoadedModel) -> Callable[..., AsyncLLM]:
    """``make_llm(**engine)``: an ``AsyncLLM`` on the tiny model (page size 4, 64 pages unless given)."""

    def make(**engine: Any) -> AsyncLLM:
        engine.setdefault("page_size", 4)
        engine.setdefault("num_pages", 64)
        engine.setdefault("model_name", TINY_NAME)
        return AsyncLLM(tiny, **engine)

    return make


@pytest.fixture(scope="module")
def tiny_server(tiny: LoadedModel) -> Iterator[Served]:
    """One server on the tiny model for a whole test module (page size 4, 256 pages)."""
    llm = AsyncLLM(tiny, page_size=4, num_pages=256, model_name=TINY_NAME)
    with serving(llm) as served:
        yield served


@pytest.fixture(scope="session")
def reference(tiny: LoadedModel) -> Callable[..., Any]:
    """``reference(prompt, **sampling)``: the ``RequestOutput`` of the request run alone by ``LLM.generate``
    (greedy unless ``temperature`` is given)."""
    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM

    llm = LLM(tiny, page_size=4, num_pages=256)

    def run(prompt: Any, **sampling: Any) -> Any:
        sampling.setdefault("temperature", 0.0)
        (out,) = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
        return out

    return run


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct (float32), loaded once (e2e tests only)."""
    return load_model("smollm2")
