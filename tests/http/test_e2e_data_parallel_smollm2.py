"""``serve -dp 2`` on the embedded SmolLM2 (issue 26, item 3): greedy outputs through two replicas under precise
routing equal one engine's, and each replica reports its own series under vLLM's ``engine`` label."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "The capital of France is a city that",
    "def fibonacci(n):",
    "def fibonacci(n):\n    if n < 2:",
    "Water boils at",
    "List of prime numbers: 2, 3, 5,",
]


def test_smollm2_dp2_precise_greedy_equals_one_engine(tmp_path: Path) -> None:
    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM

    llm = LLM("smollm2")
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))]
    server = ServerProcess("smollm2", "-dp", "2", "--threads", "2", log=tmp_path / "serve.log", name="smollm2")
    try:
        server.wait_ready(600)

        async def batch() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=600) as client:
                bodies = [{"model": "smollm2", "prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS]
                return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b) for b in bodies))

        responses = asyncio.run(batch())
        assert [r.json()["choices"][0]["text"] for r in responses] == expected
        text = httpx.get(server.url + "/metrics", timeout=60).text
        assert 'vllm:prompt_tokens_total{engine="0",model_name="smollm2"}' in text
        assert 'vllm:prompt_tokens_total{engine="1",model_name="smollm2"}' in text
    finally:
        server.stop()
