"""``AsyncLLM``: online arrival, streaming order, abort in every state with page conservation, back-pressure,
an event loop that never waits on a forward pass, shutdown and engine failure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from server_support import page_counts, random_prompts, wait_idle, words

from mechserve.api.errors import EngineStoppedError
from mechserve.api.outputs import StepOutput
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import AsyncLLM, EngineDeadError, EngineStepError, RequestRejected
from mechserve.spec import m16_request_draft_lengths as m16


def greedy(max_tokens: int, **more: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **more)


class Gate:
    """An ``on_step`` hook that stops the engine thread after the first step where ``when(core, out)`` holds,
    until ``open()``; meanwhile the test queues commands (they run before the next step)."""

    def __init__(self, when: Callable[[Any, StepOutput], bool]) -> None:
        self.when = when
        self.core: Any = None
        self.hit = threading.Event()
        self.go = threading.Event()
        self.seen: dict[str, Any] = {}

    def __call__(self, out: StepOutput) -> None:
        if not self.hit.is_set() and self.when(self.core, out):
            self.hit.set()
            assert self.go.wait(30), "the test never opened the gate"

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.hit.wait, 30), "the engine never reached the gate"

    def open(self) -> None:
        self.go.set()


def gated(make_llm: Callable[..., AsyncLLM], when: Callable[[Any, StepOutput], bool], **engine: Any) -> tuple:
    gate = Gate(when)
    llm = make_llm(on_step=gate, trace=True, **engine)
    gate.core = llm.core
    return llm, gate


def test_stream_events_come_in_step_order_and_add_up_to_the_output(make_llm, reference) -> None:
    prompt = random_prompts([9])[0]

    async def main() -> list[Any]:
        async with make_llm() as llm:
            return [event async for event in llm.stream(prompt, greedy(12))]

    events = asyncio.run(main())
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    final = events[-1].output.outputs[0]
    assert "".join(e.text for e in events) == final.text
    assert (
        [t for e in events for t in e.token_ids]
        == final.token_ids
        == reference(prompt, max_tokens=12).outputs[0].token_ids
    )
    assert all(len(e.token_ids) == 1 for e in events)  # one token per decode step (no speculation)
    assert final.finish_reason == "length"


def test_requests_added_while_the_engine_steps_equal_the_same_requests_alone(make_llm, reference) -> None:
    prompts = random_prompts([5, 17, 3, 30, 11, 8], seed=7)

    async def main() -> list[Any]:
        async with make_llm() as llm:

            async def later(i: int, prompt: list[int]) -> Any:
                await asyncio.sleep(0.004 * i)  # arrive while the earlier ones decode
                return await llm.generate(words(prompt), greedy(10 + i))

            outs = await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))
            await llm.check_pages()
            return outs

    outs = asyncio.run(main())
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == reference(prompt, max_tokens=10 + i).outputs[0].token_ids
        assert out.prompt == words(prompt)


def test_n_samples_stream_as_separate_indices(make_llm) -> None:
    async def main() -> Any:
        async with make_llm() as llm:
            events = [e async for e in llm.stream("w1 w2 w3", SamplingParams(n=3, seed=5, max_tokens=6))]
        return events

    events = asyncio.run(main())
    out = events[-1].output
    for j in range(3):
        ids = [t for e in events for d in e.samples if d.index == j for t in d.token_ids]
        assert ids == out.outputs[j].token_ids and len(ids) == 6


def test_a_slow_consumer_gets_merged_events_and_loses_nothing(make_llm) -> None:
    async def main() -> tuple[list[Any], Any]:
        async with make_llm() as llm:
            handle = await llm.add_request("w1 w2 w3", greedy(12, logprobs=1))
            await asyncio.sleep(0.1)  # every step is done before the first read
            merged = [event async for event in handle.coalesced()]
            return merged, handle.output

    merged, output = asyncio.run(main())
    final = output.outputs[0]
    assert len(merged) < 12 and merged[-1].finished
    assert "".join(e.text for e in merged) == final.text
    assert [t for e in merged for t in e.token_ids] == final.token_ids
    entries = [lp for e in merged for d in e.samples for lp in d.logprobs]
    assert [next(iter(lp)) for lp in entries] == final.token_ids
    assert all(lp[t].decoded_token == f"w{t}" for t, lp in zip(final.token_ids, entries))


# Abort in every state --------------------------------------------------------------------------------------------


def _state(core: Any, rid: str) -> Any:
    r = core.scheduler.spec_engine.live.get(rid)
    return None if r is None else r


def waiting(core: Any, out: StepOutput) -> bool:
    r = _state(core, "victim")
    return r is not None and r.state is m16.RequestState.WAITING


def prefilling(core: Any, out: StepOutput) -> bool:
    r = _state(core, "victim")
    return r is not None and "victim" in out.record.executed and 0 < r.computed < r.prompt_len


def decoding(core: Any, out: StepOutput) -> bool:
    r = _state(core, "victim")
    return r is not None and r.generated >= 2


def preempted(core: Any, out: StepOutput) -> bool:
    return "victim" in out.record.preempted


STATES = {
    # max_running 1: the victim waits behind the other request (which must still run when the victim is
    # added one await later: its 20 ids took a loaded CI machine less than that await once, so it runs 200)
    "waiting": (waiting, dict(max_running=1), 12),
    # a 4-token budget: the 30-token prompt takes several steps
    "prefilling": (prefilling, dict(max_step_tokens=4, prefix_caching=False), 30),
    "decoding": (decoding, dict(), 12),
    # 8 pages of 4: two requests of 8 + 20 tokens cannot both stay resident
    "preempted": (preempted, dict(num_pages=8), 8),
}


@pytest.mark.parametrize("state", list(STATES))
def test_abort_takes_the_request_out_at_once_and_returns_its_pages(make_llm, state: str) -> None:
    when, engine, prompt_len = STATES[state]
    other_tokens = 200 if state == "waiting" else 20
    llm, gate = gated(make_llm, when, **engine)
    other_prompt, victim_prompt = random_prompts([8, prompt_len], seed=3)
    held: dict[str, Any] = {}

    async def main() -> tuple[Any, Any, Any]:
        async with llm:
            other = await llm.add_request(other_prompt, greedy(other_tokens), request_id="other")
            victim = await llm.add_request(victim_prompt, greedy(20), request_id="victim")
            await gate.reached()
            r = llm.core.scheduler.spec_engine.live["victim"]  # the engine thread is parked in the gate
            held.update(
                pages=list(r.page_table),
                cached={p for p in r.page_table if llm.core.scheduler.spec_engine.pool.owner[p] is m16.CACHE},
            )
            aborted = llm.abort("victim")  # queued: runs before the next step
            gate.open()
            assert await aborted
            after = await llm.run_in_engine(
                lambda core: (list(core.scheduler.spec_engine.pool.owner), "victim" in core.scheduler.spec_engine.live)
            )
            return await victim.result(), await other.result(), after

    victim_out, other_out, (owners, still_live) = asyncio.run(main())
    assert not still_live and "victim" not in owners
    for page in held["pages"]:  # private pages are free again, cached prompt pages stay cached and unowned
        assert owners[page] is (m16.CACHE if page in held["cached"] else None), (page, owners[page])
    assert victim_out.outputs[0].finish_reason == "abort"
    assert other_out.outputs[0].finish_reason == "length" and len(other_out.outputs[0].token_ids) == other_tokens
    assert any("victim" in record.aborted for record in llm.trace)
    if state == "preempted":
        assert any("victim" in record.preempted for record in llm.trace)
    if state == "decoding":  # its full prompt pages were published: they must outlive it, in the cache
        assert held["cached"]
    counts = wait_idle(llm)
    assert counts["free"] + counts["cached"] == llm.core.num_pages


def test_leaving_a_stream_early_aborts_the_request(make_llm) -> None:
    async def main() -> tuple[Any, Any]:
        async with make_llm(trace=True) as llm:
            seen = 0
            async for _ in llm.stream("w4 w5 w6", greedy(200), request_id="early"):
                seen += 1
                if seen == 3:
                    break
            await asyncio.sleep(0.05)
            return await llm.run_in_engine(page_counts), llm

    counts, llm = asyncio.run(main())
    assert counts["private"] == 0
    assert any("early" in record.aborted for record in llm.trace)


def test_abort_of_an_unknown_or_finished_request_is_false(make_llm) -> None:
    async def main() -> tuple[bool, bool]:
        async with make_llm() as llm:
            await llm.generate("w1 w2", greedy(2), request_id="done")
            return await llm.abort("done"), await llm.abort("never-seen")

    assert asyncio.run(main()) == (False, False)


# Back-pressure ---------------------------------------------------------------------------------------------------


def test_a_full_waiting_queue_refuses_new_requests_as_overloaded(make_llm) -> None:
    llm, gate = gated(make_llm, lambda core, out: "first" in out.record.admitted, max_running=1, max_waiting=1)

    async def main() -> tuple[Any, Any]:
        async with llm:
            first = await llm.add_request("w1 w2 w3", greedy(8), request_id="first")
            await gate.reached()  # first runs; the next two arrive in the same batch of commands
            second = asyncio.ensure_future(llm.add_request("w4 w5", greedy(4), request_id="second"))
            third = asyncio.ensure_future(llm.add_request("w6 w7", greedy(4), request_id="third"))
            while llm._stepper.queued < 2:
                await asyncio.sleep(0.005)
            gate.open()
            accepted = await second
            with pytest.raises(RequestRejected) as refused:
                await third
            await first.result()
            await accepted.result()
            return refused.value, llm.metrics.snapshot()

    refused, snap = asyncio.run(main())
    assert refused.reason is m16.RejectReason.OVERLOADED and "max_waiting" in refused.detail
    assert snap["rejected"] == {"OVERLOADED": 1}
    wait_idle(llm)


def test_bc26_empty_prompt_is_refused_and_the_async_engine_keeps_serving(make_llm) -> None:
    async def main() -> tuple[Any, Any]:
        async with make_llm() as llm:
            running = asyncio.ensure_future(llm.generate("w1 w2 w3 w4", greedy(3)))
            for empty in ("", [], {"prompt_token_ids": []}):
                with pytest.raises(RequestRejected) as refused:
                    await llm.generate(empty, greedy(5))
                assert refused.value.reason is m16.RejectReason.EMPTY_PROMPT
            return await running, await llm.run_in_engine(page_counts)

    out, counts = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 3 and counts["private"] == 0


def test_a_prompt_that_never_fits_is_refused_naming_the_limit(make_llm) -> None:
    async def main() -> None:
        async with make_llm(num_pages=4) as llm:
            with pytest.raises(RequestRejected) as refused:
                await llm.generate(random_prompts([20])[0], greedy(10))
            assert refused.value.reason is m16.RejectReason.NEVER_FITS
            assert "the pool has 4" in refused.value.detail
            with pytest.raises(ValueError, match="not a token id"):
                await llm.generate([1, 2, 999], greedy(2))

    asyncio.run(main())


# The event loop never waits on a forward pass ----------------------------------------------------------------------


def test_the_event_loop_keeps_ticking_while_a_long_prefill_runs(make_llm) -> None:
    """The long prefill's forward waits (on the engine thread) until the event loop has ticked 20 times
    while it runs: a loop blocked by the forward could not tick, and the forward would give up after 30 s
    (an event, not a clock bound: a loaded machine only makes the ticks slower)."""
    llm = make_llm()
    executor = llm.core.executor
    real = executor.execute
    inside = threading.Event()  # the long forward is running
    ticked = threading.Event()  # the loop ticked 20 times while it ran
    waited: list[bool] = []

    def slow(plan: Any) -> Any:
        if any(len(item.token_ids) > 8 for item in plan):  # the long prefill, like a big forward
            inside.set()
            waited.append(ticked.wait(30))
            inside.clear()
        return real(plan)

    executor.execute = slow

    async def ticker(stop: asyncio.Event) -> None:
        ticks = 0
        while not stop.is_set():
            await asyncio.sleep(0.001)
            if inside.is_set():
                ticks += 1
                if ticks >= 20:
                    ticked.set()

    async def main() -> None:
        async with llm:
            stop = asyncio.Event()
            task = asyncio.ensure_future(ticker(stop))
            await llm.generate(random_prompts([40])[0], greedy(2))
            stop.set()
            await task

    asyncio.run(main())
    assert waited == [True], "the event loop did not tick while the long prefill's forward ran"


# Shutdown and failures --------------------------------------------------------------------------------------------


def test_shutdown_aborts_what_runs_and_refuses_what_comes_later(make_llm) -> None:
    async def main() -> tuple[Any, Any]:
        llm = make_llm()
        async with llm:
            stream = await llm.add_request("w1 w2", greedy(200))
            async for _ in stream:  # it runs: its first ids arrived
                break
        out = await stream.result()
        with pytest.raises(EngineStoppedError, match="stopped"):  # stopped by its owner: not a failure
            await llm.generate("w1", greedy(1))
        return out, llm

    out, llm = asyncio.run(main())
    assert out.outputs[0].finish_reason == "abort"
    assert not llm.running
    llm.core.check_pages()


def test_a_failed_step_ends_the_requests_in_flight_and_the_engine_serves_on(make_llm) -> None:
    llm = make_llm()
    executor = llm.core.executor
    real = executor.execute
    failures = iter([True])

    def flaky(plan: Any) -> Any:
        if plan and next(failures, False):
            raise RuntimeError("simulated executor failure")
        return real(plan)

    executor.execute = flaky

    async def main() -> Any:
        async with llm:
            with pytest.raises(EngineStepError, match="simulated executor failure"):
                await llm.generate("w1 w2 w3", greedy(4))
            out = await llm.generate("w1 w2 w3", greedy(4))
            await llm.check_pages()
            return out

    out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 4 and llm.running is False and llm.error is None


def test_a_submission_cancelled_before_the_engine_takes_it_never_runs(make_llm) -> None:
    llm, gate = gated(make_llm, lambda core, out: "first" in out.record.admitted)

    async def main() -> Any:
        async with llm:
            first = await llm.add_request("w1 w2", greedy(3), request_id="first")
            await gate.reached()
            late = asyncio.ensure_future(llm.add_request("w3 w4", greedy(3), request_id="late"))
            while llm._stepper.queued < 1:
                await asyncio.sleep(0.005)
            late.cancel()
            with pytest.raises(asyncio.CancelledError):
                await late
            gate.open()
            await first.result()
            return await llm.run_in_engine(lambda core: "late" in core.scheduler.spec_engine.live)

    assert asyncio.run(main()) is False
    assert not any("late" in record.admitted for record in llm.trace)
    wait_idle(llm)


def test_a_bug_in_the_engine_thread_fails_every_waiter_instead_of_hanging_them(make_llm) -> None:
    llm = make_llm()

    def broken(*args: Any) -> Any:
        raise KeyError("a bug")

    llm._stepper._events = broken  # type: ignore[method-assign]

    async def main() -> None:
        async with llm:
            with pytest.raises(EngineDeadError, match="died"):
                await asyncio.wait_for(llm.generate("w1 w2", greedy(3)), 10)
            assert not llm.running and llm.error is not None
            with pytest.raises(EngineDeadError) as refused:
                await llm.generate("w1", greedy(1))
            assert not isinstance(refused.value, EngineStoppedError)  # dead, not stopped: the server's engine_dead

    asyncio.run(main())


def test_metrics_count_preemptions_prefix_hits_and_latencies(make_llm) -> None:
    shared = random_prompts([16], seed=11)[0]

    async def main() -> dict[str, Any]:
        async with make_llm(num_pages=8) as llm:
            await llm.generate([*shared, 1, 2], greedy(4))
            await llm.generate([*shared, 3, 4], greedy(4))  # reuses the first one's cached prompt pages
            await asyncio.gather(*(llm.generate(p, greedy(20)) for p in random_prompts([8, 8], seed=2)))
            return llm.metrics.snapshot()

    snap = asyncio.run(main())
    assert snap["preemptions"] >= 1
    assert snap["prefix_cache_hits"] == 16 and 0 < snap["prefix_cache_hit_rate"] < 1
    assert snap["ttft_count"] == 4 and snap["itl_count"] == 3 + 3 + 19 + 19
    assert snap["finished"] == {"length": 4}
    assert snap["generation_tokens"] == 4 + 4 + 20 + 20
