"""Load: 64 concurrent streaming openai clients, about a quarter of them leaving early, a fixed number of requests.

Every request that completes has exactly the text of the same request run alone (greedy, ``LLM.generate``),
no response is a 5xx, and afterwards every page is free or cached (no leak).  The run prints requests/s and
the client-side TTFT and ITL percentiles (``-s`` shows them).  The tiny model runs in CI; SmolLM2 is ``slow``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from server_support import TINY_NAME, random_prompts, serving, words

from mechserve.bench.serve_client import percentile
from mechserve.entrypoints.async_llm import AsyncLLM

CLIENTS = 64
LEAVE_SHARE = 0.25


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    leave_after: int | None  # chunks read before the client disconnects (None: reads to the end)


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    status: int | None = None  # an HTTP error's status
    left: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)


def jobs(prompts: Sequence[str], lengths: Sequence[int], count: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(rng.choice(prompts), rng.choice(lengths), rng.randint(1, 3) if rng.random() < LEAVE_SHARE else None)
        for _ in range(count)
    ]


async def one(client: Any, model: str, job: Job) -> Outcome:
    out = Outcome()
    sent = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=0, stream=True
        )
        chunks = 0
        async for chunk in stream:
            choice = chunk.choices[0]
            now = time.perf_counter()
            if choice.text:
                if out.ttft is None:
                    out.ttft = now - sent
                else:
                    out.itl.append(now - last)
                last = now
            out.text += choice.text
            out.finish_reason = choice.finish_reason or out.finish_reason
            chunks += 1
            if job.leave_after is not None and chunks >= job.leave_after:
                out.left = True
                await stream.close()
                break
    except openai.APIStatusError as exc:
        out.status = exc.status_code
    return out


async def drive(url: str, model: str, work: Sequence[Job], clients: int = CLIENTS) -> tuple[list[Outcome], float]:
    """``clients`` concurrent clients take the jobs in order; returns the outcomes (job order) and the wall time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(work)):
        queue.put_nowait(i)
    outcomes: list[Outcome | None] = [None] * len(work)

    async def worker(client: Any) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            outcomes[i] = await one(client, model, work[i])

    started = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return [o for o in outcomes if o is not None], time.perf_counter() - started


def check_and_report(
    name: str, served: Any, work: Sequence[Job], outcomes: Sequence[Outcome], wall: float, alone: Callable
) -> dict[str, Any]:
    """Zero 5xx, every completed text equal to the request alone, no page leaked; returns the numbers."""
    assert len(outcomes) == len(work)
    assert not [o.status for o in outcomes if o.status is not None], "some requests failed"
    completed = [(j, o) for j, o in zip(work, outcomes) if not o.left]
    assert len(completed) >= len(work) // 2 and any(o.left for o in outcomes)
    for job, out in completed:
        assert out.finish_reason is not None
        assert out.text == alone(job.prompt, job.max_tokens), job
    counts = served.wait_idle()
    assert counts["free"] + counts["cached"] == served.llm.core.num_pages and counts["private"] == 0
    ttft = [o.ttft for _, o in completed if o.ttft is not None]
    itl = [gap for _, o in completed for gap in o.itl]
    snap = served.llm.metrics.snapshot()
    report = {
        "model": name,
        "clients": CLIENTS,
        "requests": len(work),
        "completed": len(completed),
        "left_early": len(work) - len(completed),
        "seconds": round(wall, 2),
        "requests_per_s": round(len(work) / wall, 1),
        "ttft_ms_p50": round(1000 * percentile(ttft, 50), 1),
        "ttft_ms_p99": round(1000 * percentile(ttft, 99), 1),
        "itl_ms_p50": round(1000 * percentile(itl, 50), 1),
        "itl_ms_p99": round(1000 * percentile(itl, 99), 1),
        "generation_tokens": snap["generation_tokens"],
        "preemptions": snap["preemptions"],
        "prefix_cache_hit_rate": round(snap["prefix_cache_hit_rate"], 3),
        "aborted": snap["finished"].get("abort", 0),
    }
    print(f"\nLOAD {json.dumps(report)}")
    return report


def test_load_tiny_64_streaming_clients(tiny, reference) -> None:
    shared = random_prompts([12, 12, 12], seed=31)
    tails = random_prompts([1, 3, 7, 15, 30, 40], seed=32)
    prompts = [words(s + t) for s in shared for t in tails]
    work = jobs(prompts, [4, 9, 16, 24, 40], count=192, seed=5)
    llm = AsyncLLM(tiny, page_size=4, num_pages=1024, model_name=TINY_NAME)
    alone = _memo(lambda prompt, n: reference(prompt, max_tokens=n).outputs[0].text)
    with serving(llm) as served:
        outcomes, wall = asyncio.run(drive(served.url, TINY_NAME, work))
        report = check_and_report("tiny", served, work, outcomes, wall, alone)
    assert report["aborted"] >= 1


PASSAGES = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are red, yellow and",
    "1, 2, 3, 5, 8, 13,",
    "The quick brown fox jumps over the lazy dog. The quick",
    "Water boils at a temperature of",
    "A haiku about the autumn moon:",
]
SYSTEM = "You are a careful assistant. You answer in one short sentence and you never invent facts.\n\n"


@pytest.mark.slow
@pytest.mark.e2e
def test_load_smollm2_64_streaming_clients(smollm2) -> None:
    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM

    prompts = [p for passage in PASSAGES for p in (passage, SYSTEM + passage)]
    work = jobs(prompts, [8, 16, 24], count=128, seed=6)
    solo = LLM(smollm2, num_pages=64, max_step_tokens=512)

    def run_alone(prompt: str, n: int) -> str:
        (out,) = solo.generate([prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
        return out.outputs[0].text

    llm = AsyncLLM(smollm2, max_step_tokens=512, model_name="smollm2")
    with serving(llm) as served:
        outcomes, wall = asyncio.run(drive(served.url, "smollm2", work))
        check_and_report("smollm2", served, work, outcomes, wall, _memo(run_alone))


def _memo(fn: Callable[[str, int], str]) -> Callable[[str, int], str]:
    seen: dict[tuple[str, int], str] = {}

    def cached(prompt: str, n: int) -> str:
        if (prompt, n) not in seen:
            seen[(prompt, n)] = fn(prompt, n)
        return seen[(prompt, n)]

    return cached
