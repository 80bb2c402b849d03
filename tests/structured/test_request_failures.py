"""A request that fails inside a step on its own account fails alone (issue 31's first finding).

Its grammar's matcher raising (planted on its Nth call, or a grammar llguidance compiles but cannot run:
a 2,001-way alternative), or its logits processing raising: the executor isolates it (its item still
gets a valid outcome), reports it (``take_failures``), and ``EngineCore`` ends it keeping nothing of that
step, with a ``RequestFailed`` naming ``structured_outputs``; every other request gets exactly the ids it
gets without it, every page returns, and the log gets one line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from tiny_engines import byte_core

from mechserve.api.errors import ParamError, RequestFailed
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.executor import sampling
from mechserve.executor.structured import GrammarMatcher
from mechserve.model.loader import LoadedModel

PROMPTS = ["hello hello hello", "count: 1 2 3", '{"a":', "x y z"]
FAILING = r"[0-9]{4,9}"  # the grammar the planted failure picks out
WIDE = "start: " + " | ".join(f'"w{i}"' for i in range(2001))  # issue 31: compiles, fails on its first id


def params_of(kind: str) -> SamplingParams:
    so = {"good": {"regex": "[a-z ]{3,12}"}, "bad": {"regex": FAILING}, "wide": {"grammar": WIDE}}.get(kind)
    return SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so)


def run(core: EngineCore, loaded: LoadedModel, kinds: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request per kind (prompt i), all at once: the outputs and the failures by request id."""
    tok = loaded.tokenizer
    for i, kind in enumerate(kinds):
        core.add_request(tok.encode(PROMPTS[i]), params_of(kind), request_id=f"r{i}")
    done: dict[str, Any] = {}
    failed: dict[str, Any] = {}
    while core.has_unfinished():
        out = core.step()
        done.update((o.request_id, o.outputs[0].token_ids) for o in out.finished)
        failed.update(out.failed)
        assert not any(d.request_id in failed for d in out.deltas), "a failed request streams nothing more"
    return done, failed


def assert_idle(core: EngineCore) -> None:
    core.check_pages()
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.pages.private) == (0, 0, 0)
    assert not core.executor._requests, "the executor forgot every request"  # type: ignore[attr-defined]


def test_a_grammar_failing_inside_a_step_fails_its_request_alone(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kinds = ["plain", "good", "bad", "plain"]
    want, _ = run(byte_core(byte_model), byte_model, ["plain", "good", "good", "plain"])
    calls = {"n": 0}
    original = GrammarMatcher.window_masks

    def third_call_fails(self: GrammarMatcher, *args: Any) -> int:
        if self.grammar.key == ("regex", FAILING):
            calls["n"] += 1
            if calls["n"] == 3:
                raise ValueError("planted matcher failure\n" + "a grammar dump " * 1000)
        return original(self, *args)

    monkeypatch.setattr(GrammarMatcher, "window_masks", third_call_fails)
    core = byte_core(byte_model)
    with caplog.at_level(logging.WARNING, logger="mechserve.engine"):
        done, failed = run(core, byte_model, kinds)
    assert list(failed) == ["r2"] and set(done) == {"r0", "r1", "r3"}
    error = failed["r2"]
    assert isinstance(error, RequestFailed) and error.param == "structured_outputs"
    assert "planted matcher failure" in str(error) and "\n" not in str(error) and "grammar dump" not in str(error)
    assert {rid: done[rid] for rid in ("r0", "r1", "r3")} == {rid: want[rid] for rid in ("r0", "r1", "r3")}
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 1 and "r2" in lines[0] and "\n" not in lines[0] and len(lines[0]) < 400
    assert_idle(core)


def test_a_grammar_that_compiles_but_cannot_run_fails_alone(byte_model: LoadedModel) -> None:
    """Issue 31's 2,001-way Lark alternative (unless compile-time validation refuses it already)."""
    core = byte_core(byte_model)
    try:
        core.compile_grammar(params_of("wide").structured_outputs)  # type: ignore[arg-type]
    except ParamError as exc:  # refused at compile time (the stronger guard): nothing reaches a step
        assert exc.param == "structured_outputs"
        return
    want, _ = run(byte_core(byte_model), byte_model, ["plain", "good", "plain"])
    done, failed = run(core, byte_model, ["plain", "good", "wide", "plain"])
    assert list(failed) == ["r2"] and failed["r2"].param == "structured_outputs"
    assert "2002 items" in str(failed["r2"]) and "\n" not in str(failed["r2"])
    assert done["r0"] == want["r0"] and done["r1"] == want["r1"]
    assert done["r3"] != [] and len(done["r3"]) == 12
    assert_idle(core)


def test_a_logits_processor_failing_fails_its_request_alone(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose own logits processing raises (a bad logits-processor state) fails alone; the step's
    other rows, processed or not, are chosen as they would have been."""
    biased = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={5: 3.0})
    tok = byte_model.tokenizer

    def submit(core: EngineCore, names: Sequence[str]) -> None:
        for i, name in enumerate(names):
            core.add_request(tok.encode(PROMPTS[i]), biased, request_id=name)

    alone = byte_core(byte_model)
    submit(alone, ["a", "b", "ok"])
    want = {o.request_id: o.outputs[0].token_ids for o in alone.run_until_idle()}
    original = sampling._process_row
    seen = {"n": 0}

    def fails_for_bad(x: Any, row: sampling.Row) -> None:
        if row.request is not None and row.request.request_id == "bad":
            seen["n"] += 1
            if seen["n"] >= 2:
                raise RuntimeError("logits processor state lost")
        original(x, row)

    monkeypatch.setattr(sampling, "_process_row", fails_for_bad)
    core = byte_core(byte_model)
    submit(core, ["a", "b", "bad"])
    core.add_request(tok.encode(PROMPTS[3]), biased, request_id="ok")
    done, failed = {}, {}
    while core.has_unfinished():
        out = core.step()
        done.update((o.request_id, o.outputs[0].token_ids) for o in out.finished)
        failed.update(out.failed)
    assert list(failed) == ["bad"] and failed["bad"].param is None
    assert "logits processor state lost" in str(failed["bad"])
    assert done["a"] == want["a"] and done["b"] == want["b"]
    assert_idle(core)


def test_a_failed_request_with_several_samples_ends_every_sample(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = GrammarMatcher.window_masks

    def fails(self: GrammarMatcher, *args: Any) -> int:
        if self.grammar.key == ("regex", FAILING) and len(self.tokens) >= 2:
            raise ValueError("planted")
        return original(self, *args)

    monkeypatch.setattr(GrammarMatcher, "window_masks", fails)
    core = byte_core(byte_model)
    tok = byte_model.tokenizer
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8, structured_outputs={"regex": FAILING})
    core.add_request(tok.encode("x"), params, request_id="many")
    core.add_request(tok.encode("y"), params_of("plain"), request_id="other")
    failed, done = {}, set()
    while core.has_unfinished():
        out = core.step()
        failed.update(out.failed)
        done |= {o.request_id for o in out.finished}
    assert list(failed) == ["many"] and done == {"other"}
    assert_idle(core)


def test_llm_generate_returns_the_others_and_names_the_failed_prompt(
    byte_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mechserve.entrypoints.llm import LLM, RequestsRejected

    original = GrammarMatcher.window_masks

    def fails(self: GrammarMatcher, *args: Any) -> int:
        if self.grammar.key == ("regex", FAILING):
            raise ValueError("planted")
        return original(self, *args)

    monkeypatch.setattr(GrammarMatcher, "window_masks", fails)
    llm = LLM(byte_model, page_size=4, num_pages=128)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    with pytest.raises(RequestsRejected, match=r"1 of 3 prompt.* failed") as caught:
        llm.generate(prompts, [params_of("plain"), params_of("bad"), params_of("good")], use_tqdm=False)
    err = caught.value
    assert list(err.errors) == [1] and isinstance(err.errors[1], RequestFailed)
    assert err.outputs[1] is None and err.outputs[0] is not None and err.outputs[2] is not None
    llm.core.check_pages()
