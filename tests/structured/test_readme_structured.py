"""The README's Structured outputs section runs as written: the ``LLM`` example on SmolLM2, and the ``openai``
example against a server on SmolLM2 (both print JSON that parses)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECTION = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
SECTION = SECTION.split("## Structured outputs", 1)[1].split("\n## ", 1)[0]


def run_block(code: str, scope: dict) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), scope)
    return out.getvalue().splitlines()


def test_the_llm_and_openai_examples_run() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
    from server_support import serving

    from mechserve.entrypoints.async_llm import AsyncLLM

    llm_block, client_block = re.findall(r"```python\n(.*?)```", SECTION, re.S)
    scope: dict = {}
    lines = run_block(llm_block, scope)
    city = json.loads(lines[0].replace("'", '"'))
    assert set(city) == {"city", "population"}
    assert lines[1] in {"yes", "no"}
    with serving(AsyncLLM("smollm2", model_name="smollm2")) as served:
        code = client_block.replace("http://127.0.0.1:8000", served.url)
        (line,) = run_block(code, scope)
    assert set(json.loads(line.replace("'", '"'))) == {"city", "population"}
