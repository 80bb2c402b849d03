"""``EngineCore`` on the tiny random Llama: submission checks, n > 1, abort, staggered arrivals, streaming, pages."""

from __future__ import annotations

import re

import pytest
from tiny_engines import VOCAB, core, drain, hf_greedy, random_prompts

from mechserve.api.errors import RequestRejected
from mechserve.api.params import SamplingParams
from mechserve.bench.timings import trace_stats
from mechserve.engine.core import EngineCore
from mechserve.spec import m16_request_draft_lengths as m16

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def finished(outs) -> dict:
    return {o.request_id: o for out in outs for o in out.finished}


def test_greedy_ids_equal_transformers(tiny, tiny_hf) -> None:
    c = core(tiny, max_step_tokens=16)
    prompts = random_prompts([5, 17, 3, 30])
    ids = [c.add_request(p, GREEDY) for p in prompts]
    done = finished(drain(c))
    for rid, prompt in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == hf_greedy(tiny_hf, prompt, 8)
        assert done[rid].prompt_token_ids == prompt and done[rid].finished
    c.check_pages()


def test_staggered_arrivals_give_the_same_ids(tiny, tiny_hf) -> None:
    """Requests added while others run (at different steps) are unaffected by their batchmates."""
    c = core(tiny, max_step_tokens=12, page_size=2)
    prompts = random_prompts([9, 4, 21, 6, 13], seed=7)
    submitted, outs = {}, []
    for k, prompt in enumerate(prompts):
        submitted[c.add_request(prompt, GREEDY)] = prompt
        for _ in range(k + 1):  # 1, 2, 3, ... steps between arrivals
            outs.append(c.step())
    outs += drain(c)
    done = finished(outs)
    for rid, prompt in submitted.items():
        assert done[rid].outputs[0].token_ids == hf_greedy(tiny_hf, prompt, 8), rid
    c.check_pages()


def test_the_stream_adds_up_to_the_output(tiny) -> None:
    c = core(tiny)
    rid = c.add_request(random_prompts([6])[0], SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))
    outs = drain(c)
    deltas = [d for out in outs for d in out.deltas if d.request_id == rid]
    (final,) = [o for out in outs for o in out.finished]
    done = final.outputs[0]
    assert "".join(d.text for d in deltas) == done.text == "".join(f" w{t}" for t in done.token_ids)
    assert [t for d in deltas for t in d.token_ids] == done.token_ids
    # vLLM's shape: one dict per id, the chosen id first, then the top 3
    assert [next(iter(lp)) for d in deltas for lp in d.logprobs] == done.token_ids
    assert all(len(lp) in (3, 4) and lp[t].rank >= 1 for t, lp in zip(done.token_ids, done.logprobs))
    assert all(lp[t].decoded_token == f"w{t}" for t, lp in zip(done.token_ids, done.logprobs))
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_n_samples_fan_out(tiny) -> None:
    c = core(tiny)
    prompt = random_prompts([5])[0]
    rid = c.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6))
    outs = drain(c)
    assert {rid for out in outs for rid in out.record.admitted} == {f"{rid}#0", f"{rid}#1", f"{rid}#2"}
    (done,) = finished(outs).values()
    assert [o.index for o in done.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in done.outputs)
    assert len({tuple(o.token_ids) for o in done.outputs}) > 1  # seeds 11, 12, 13
    again = core(tiny)
    again.add_request(prompt, SamplingParams(temperature=1.0, seed=12, max_tokens=6))
    (one,) = finished(drain(again)).values()
    assert one.outputs[0].token_ids == done.outputs[1].token_ids  # sample j is seed + j
    c.check_pages()


def test_abort_mid_run(tiny, tiny_hf) -> None:
    c = core(tiny, max_step_tokens=8)
    keep, drop = random_prompts([7, 12], seed=3)
    a = c.add_request(keep, SamplingParams(temperature=0.0, max_tokens=10))
    b = c.add_request(drop, SamplingParams(temperature=0.0, max_tokens=10))
    outs = [c.step() for _ in range(4)]
    assert c.abort(b) and not c.abort(b) and not c.abort("nope")
    assert c.stats().pages.private > 0  # a still holds its pages
    outs += drain(c)
    done = finished(outs)
    assert done[b].outputs[0].finish_reason == "abort" and done[b].finished
    assert len(done[b].outputs[0].token_ids) < 10
    assert done[a].outputs[0].token_ids == hf_greedy(tiny_hf, keep, 10)
    assert any(b in out.record.aborted for out in outs)
    c.check_pages()


def test_page_conservation_with_prefix_caching(tiny) -> None:
    c = core(tiny, page_size=4, num_pages=40)
    shared = random_prompts([17], seed=5)[0]
    for tail in random_prompts([3, 5, 2], seed=6):
        c.add_request(shared + tail, GREEDY)
    outs = drain(c)
    c.add_request([*shared, 1, 2], GREEDY)
    outs += drain(c)
    assert sum(sum(out.record.reused.values()) for out in outs) > 0
    pages = c.stats().pages
    assert pages.cached > 0 and pages.free + pages.cached == c.num_pages
    c.check_pages()


def test_a_burst_behind_a_shared_prompt_computes_it_once(tiny) -> None:
    """``EngineConfig.hold_shared_prefix`` (on by default, m12 N24): requests submitted together behind a
    24-token shared prompt wait until the first has published it, then reuse all of it, with the same ids
    as without the hold."""
    shared = random_prompts([24], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 3, 3, 3], seed=8)]

    def prefill(**config: object) -> tuple[int, list[list[int]]]:
        c = core(tiny, page_size=4, num_pages=64, max_step_tokens=8, **config)
        ids = [c.add_request(p, GREEDY) for p in prompts]
        outs = drain(c)
        c.check_pages()
        done = finished(outs)
        return trace_stats([out.record for out in outs])["prefill_tokens_computed"], [
            list(done[i].outputs[0].token_ids) for i in ids
        ]

    held, held_ids = prefill()
    plain, plain_ids = prefill(hold_shared_prefix=False)
    uncached, uncached_ids = prefill(prefix_caching=False)
    assert held == 24 + 4 * 3  # the shared prompt once, then each request's own 3 tokens
    assert held < plain < uncached == 4 * 27
    assert held_ids == plain_ids == uncached_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "EMPTY_PROMPT (the prompt has no tokens)"),
        ([VOCAB], GREEDY, f"prompt token id {VOCAB} at position 0 is not a token id of this model"),
        ([1, -1], GREEDY, "prompt token id -1 at position 1"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 5]), f"stop_token_ids: {VOCAB + 5} is not a token id"),
        ([1] * 400, SamplingParams(max_tokens=200), "TOO_LONG (a prompt of 400 token(s) + 200 new token(s) = 600"),
        ([1] * 100, SamplingParams(max_tokens=200), "NEVER_FITS (needs 75 pages of 4 positions, the pool has 64)"),
        ("w1 w2", GREEDY, "must be a sequence of token ids, not text"),
        ([1, 2], {"temperature": 0}, "params must be a SamplingParams"),
    ],
)
def test_bad_requests_are_rejected_at_submission_and_the_rest_keeps_running(
    tiny, tiny_hf, prompt, params, message
) -> None:
    c = core(tiny)
    good = random_prompts([6, 9], seed=9)
    first = c.add_request(good[0], GREEDY)
    c.step()
    with pytest.raises(ValueError, match=re.escape(message)):
        c.add_request(prompt, params)
    second = c.add_request(good[1], GREEDY)
    done = finished(drain(c))
    assert set(done) == {first, second}
    for rid, p in zip((first, second), good):
        assert done[rid].outputs[0].token_ids == hf_greedy(tiny_hf, p, 8)
    c.check_pages()
    assert c.stats().pages.private == 0


def test_door_refusals_are_request_rejected_and_in_the_trace(tiny) -> None:
    c = core(tiny)
    with pytest.raises(RequestRejected) as info:
        c.add_request([], GREEDY, request_id="empty")
    assert info.value.reason is m16.RejectReason.EMPTY_PROMPT and info.value.request_id == "empty"
    assert c.has_unfinished()  # the refusal is still to be recorded
    (out,) = drain(c)
    assert out.record.rejected == (("empty", m16.RejectReason.EMPTY_PROMPT),)
    c.add_request([1, 2, 3], GREEDY, request_id="x")
    with pytest.raises(RequestRejected, match="DUPLICATE_ID"):
        c.add_request([1, 2, 3], GREEDY, request_id="x")
    drain(c)
    c.add_request([1, 2, 3], GREEDY, request_id="x")  # an id may be used again once its request has left
    drain(c)
    c.check_pages()


def test_max_waiting_refuses_overload_without_leaving_samples_behind(tiny) -> None:
    c = core(tiny, max_waiting=2)
    c.add_request([1, 2], GREEDY)
    with pytest.raises(RequestRejected, match="OVERLOADED"):
        c.add_request([3, 4], SamplingParams(n=2, temperature=0.0, max_tokens=2))  # sample 0 fits, sample 1 not
    done = finished(drain(c))
    assert list(done) == ["0"]
    assert all(r.state is not m16.RequestState.WAITING for r in c.scheduler.spec_engine.requests)
    c.check_pages()


def test_zero_max_tokens_finishes_with_length(tiny) -> None:
    c = core(tiny)
    c.add_request([1, 2, 3], SamplingParams(max_tokens=0))
    (done,) = finished(drain(c)).values()
    assert done.outputs[0].token_ids == [] and done.outputs[0].finish_reason == "length"
    assert done.outputs[0].text == "" and done.metrics.first_token_time is None


def test_metrics_are_monotonic(tiny) -> None:
    c = core(tiny, max_step_tokens=4)
    c.add_request(random_prompts([10])[0], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=5))
    (done,) = finished(drain(c)).values()
    m = done.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert 0 <= m.ttft <= m.e2e
    for times in m.token_times:
        assert len(times) == 5 and list(times) == sorted(times)
        assert m.first_token_time <= times[0] and times[-1] <= m.finished_time


def test_never_fits_names_the_pool(tiny) -> None:
    c = EngineCore(tiny, core(tiny, num_pages=3, page_size=2).config)
    with pytest.raises(RequestRejected, match=r"needs 5 pages of 2 positions, the pool has 3"):
        c.add_request([1] * 6, SamplingParams(max_tokens=4))


def test_max_model_len_beyond_the_models_context_is_refused_at_construction() -> None:
    """As vLLM: the model's cos/sin and training end at max_position_embeddings, so a longer max_model_len is
    an error naming both, not a setting that lets requests run past it (a new user's trial)."""
    from mechserve.api.config import EngineConfig
    from mechserve.engine.core import EngineCore
    from mechserve.model.loader import load_model

    loaded = load_model("smollm2", tokenizer=False)
    with pytest.raises(ValueError, match="max_model_len 8193 is more than the model's context of 8192 positions"):
        EngineCore(loaded, EngineConfig(num_pages=8, max_model_len=8193))
    assert EngineCore(loaded, EngineConfig(num_pages=8, max_model_len=8192)).max_model_len == 8192
