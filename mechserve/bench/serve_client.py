"""``mechserve bench serve``: drive a running OpenAI-compatible server with Poisson arrivals.

Requests arrive as a Poisson process of ``--rate`` requests/s (exponential
gaps; ``inf``: all at once), optionally capped at ``--max-concurrency`` in
flight, until ``--num-requests`` have been sent or ``--duration`` seconds
have passed.  Each streams (``stream: true`` with usage) a synthetic prompt
of ``--input-len`` random common words (about one token each for a BPE
tokenizer) and asks for exactly ``--output-len`` tokens (greedy,
``ignore_eos``).  Timings are the client's: TTFT from sending the request to
the first chunk with text, ITL between two chunks with text, E2E to the last
byte.  ``--workload multi-tenant`` sends issue 26's routing workload instead
(``mechserve.bench.fleet_workloads.tenants`` as text: ``--tenants`` tenants, each
with its own system prompt of up to ``--system-len`` words, Zipf-popular, each
request one tenant's system prompt and a user message of up to ``--input-len``
words), so that a cache-aware router has prefixes to find.  The report is one JSON
object with vLLM's benchmark names::

    completed, failed, errors (status -> count), duration, total_input_tokens, total_output_tokens,
    request_throughput (req/s), output_throughput (tok/s),
    mean_/p50_/p99_ ttft_ms, itl_ms, e2el_ms

The module's top level imports only the standard library; ``httpx`` (the
``serve`` extra) is imported when the benchmark runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from mechserve.cli.parser import Bounded

_WORD_TEXT = (
    "the of and to in is was that for on with as by at from his her they which this be are an or had not but "
    "what all were when we there can more if out so said one about up into some could them other than then time "
    "only new after first also over two years people work city world water house story light river garden music"
)
WORDS = tuple(_WORD_TEXT.split())
BENCH_WORKLOADS = ("random", "multi-tenant")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to send, how fast, and where."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    rate: float = math.inf
    num_requests: int = 100
    duration: float | None = None
    input_len: int = 64
    output_len: int = 64
    max_concurrency: int | None = None
    seed: int = 0
    timeout: float = 300.0
    workload: str = "random"
    tenants: int = 16
    system_len: int = 512


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (times in seconds)."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    add = parser.add_argument
    add("--url", default=d.url, help=f"the server (default {d.url})")
    add("--model", default=None, help="the model name to send (default: the server's first model)")
    add("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    add("--endpoint", choices=("completions", "chat"), default=d.endpoint, help="which API to drive")
    add(
        "--rate",
        type=Bounded(float, gt=0),
        default=d.rate,
        help="requests per second, Poisson (default inf: all at once)",
    )
    add(
        "--num-requests", type=Bounded(int, ge=1), default=d.num_requests, metavar="N", help=f"default {d.num_requests}"
    )
    add("--duration", type=Bounded(float, gt=0), default=None, metavar="S", help="stop sending after S seconds")
    add(
        "--input-len",
        type=Bounded(int, ge=1),
        default=d.input_len,
        metavar="N",
        help=f"prompt words (default {d.input_len})",
    )
    add(
        "--output-len",
        type=Bounded(int, ge=1),
        default=d.output_len,
        metavar="N",
        help=f"tokens (default {d.output_len})",
    )
    add("--max-concurrency", type=Bounded(int, ge=1), default=None, metavar="N", help="requests in flight at most")
    add("--seed", type=int, default=d.seed, help="seed of the prompts and the arrival times")
    add("--timeout", type=Bounded(float, gt=0), default=d.timeout, metavar="S", help="per request, seconds")
    add(
        "--workload",
        choices=BENCH_WORKLOADS,
        default=d.workload,
        help="random: --input-len random words per prompt (default); multi-tenant: issue 26's tenants with their "
        "own system prompts (--tenants, --system-len), each request a tenant's system prompt and a message",
    )
    add("--tenants", type=Bounded(int, ge=1), default=d.tenants, metavar="N", help=f"multi-tenant: default {d.tenants}")
    add(
        "--system-len",
        type=Bounded(int, ge=1),
        default=d.system_len,
        metavar="N",
        help=f"multi-tenant: system prompts of N/2 to N words (default {d.system_len})",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its report (JSON); ``CliError`` if the server cannot be reached."""
    from mechserve.cli.errors import CliError

    try:
        import httpx
    except ModuleNotFoundError as exc:
        raise CliError(f"bench serve needs {exc.name!r}: pip install 'mechserve[serve]'") from None
    names = {f.name for f in fields(BenchConfig)}
    config = BenchConfig(**{k: v for k, v in vars(args).items() if k in names})
    try:
        report = asyncio.run(benchmark(config))
    except (httpx.HTTPError, OSError, KeyError, IndexError, ValueError) as exc:
        raise CliError(f"cannot benchmark {config.url}: {type(exc).__name__}: {exc}") from None
    print(json.dumps(report, indent=2), flush=True)
    return 0


async def benchmark(config: BenchConfig) -> dict[str, Any]:
    """Send the requests on their Poisson schedule; return the report."""
    import httpx

    rng = random.Random(config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=config.timeout, limits=limits) as client:
        model = config.model or await _first_model(client)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        tasks: list[asyncio.Task[RequestResult]] = []
        texts = iter(multi_tenant_prompts(config)) if config.workload == "multi-tenant" else None
        started = time.perf_counter()
        for offset in arrivals(config.rate, config.num_requests, config.duration, rng):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            text = next(texts) if texts is not None else prompt(rng, config.input_len)
            body = request_body(config, model, text)
            tasks.append(asyncio.create_task(_gated(gate, one_request(client, config.endpoint, body))))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(results, duration, config)


def arrivals(rate: float, count: int, duration: float | None, rng: random.Random) -> Iterator[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate``/s: ``count`` of them, none after
    ``duration``."""
    t = 0.0
    for _ in range(count):
        if duration is not None and t > duration:
            return
        yield t
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def multi_tenant_prompts(config: BenchConfig) -> list[str]:
    """``config.num_requests`` prompts of ``fleet_workloads.tenants`` (seeded by ``config.seed``) as text: each
    token id is one of ``WORDS``, so a tenant's system prompt is the same text in every request of it."""
    from mechserve.bench.fleet_workloads import Sizes, tenants

    sizes = Sizes(
        requests=config.num_requests,
        tenants=config.tenants,
        system=(max(config.system_len // 2, 1), config.system_len),
        message=(max(config.input_len // 2, 1), config.input_len),
        output=(config.output_len, config.output_len),
    )
    workload = tenants(sizes, config.seed)
    out: list[str] = []
    step = 0
    while not workload.exhausted:
        out += [" ".join(WORDS[t % len(WORDS)] for t in a.tokens) for a in workload.due(step)]
        step += 1
    return out


def request_body(config: BenchConfig, model: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def one_request(client: Any, endpoint: str, body: dict[str, Any]) -> RequestResult:
    """Stream one request; time its chunks."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    result = RequestResult()
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = str(response.status_code)
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = "stream error"
                    return result
                now = time.perf_counter()
                if any(_chunk_text(choice) for choice in chunk.get("choices", ())):
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.ok = True
    except Exception as exc:  # a refused connection, a timeout, a broken stream: counted, not fatal
        result.error = type(exc).__name__
    finally:
        result.e2e = time.perf_counter() - sent
    return result


def summarize(results: Sequence[RequestResult], duration: float, config: BenchConfig) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    report: dict[str, Any] = {
        "workload": config.workload,
        "endpoint": config.endpoint,
        "rate": None if math.isinf(config.rate) else config.rate,
        "max_concurrency": config.max_concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft for r in done if r.ttft is not None]),
        ("itl", [gap for r in done for gap in r.itl]),
        ("e2el", [r.e2e for r in done]),
    ):
        report[f"mean_{name}_ms"] = 1000 * sum(values) / len(values) if values else None
        report[f"p50_{name}_ms"] = 1000 * percentile(values, 50) if values else None
        report[f"p99_{name}_ms"] = 1000 * percentile(values, 99) if values else None
    return report


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def _first_model(client: Any) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _gated(gate: asyncio.Semaphore | None, work: Coroutine[Any, Any, RequestResult]) -> RequestResult:
    if gate is None:
        return await work
    async with gate:
        return await work


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
