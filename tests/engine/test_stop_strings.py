"""Stop strings, EOS and stop ids through the real engine (EngineCore: m12 + TorchExecutor), on a rigged model.

Field case BC19: vLLM once tested only whether the output *ended* with a
stop string, so stop "DE" inside token "DEF" was never found.  Here the
rigged model greedily emits ABC, DEF, GHI, ABC, ... through the real executor
and a toy tokenizer whose tokens are those multi-character strings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_engines import ToyTokenizer, core, drain, rigged

from mechserve.api.params import SamplingParams
from mechserve.spec import m16_request_draft_lengths as m16

TOKENS = [b"ABC", b"DEF", b"GHI", b"X", b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac", b"Y"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory):
    """The rigged model: X -> ABC -> DEF -> GHI -> ABC ...; Y -> é (2 tokens) -> € (3 tokens) -> é ..."""
    tok = ToyTokenizer(TOKENS)
    i = {piece: tok.id(piece) for piece in TOKENS}
    successor = {
        i[b"X"]: i[b"ABC"],
        i[b"ABC"]: i[b"DEF"],
        i[b"DEF"]: i[b"GHI"],
        i[b"GHI"]: i[b"ABC"],
        i[b"Y"]: i[b"\xc3"],
        i[b"\xc3"]: i[b"\xa9"],
        i[b"\xa9"]: i[b"\xe2"],
        i[b"\xe2"]: i[b"\x82"],
        i[b"\x82"]: i[b"\xac"],
        i[b"\xac"]: i[b"\xc3"],
    }
    return rigged(tmp_path_factory.mktemp("rigged"), tok, successor), i


def greedy(max_tokens: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_bc19_stop_string_inside_and_across_tokens(toy) -> None:
    loaded, i = toy
    c = core(loaded)
    x = [i[b"X"]]
    r1 = c.add_request(x, greedy(stop=["DE"]), request_id="R1")
    r2 = c.add_request(x, greedy(stop=["CD"]), request_id="R2")
    r3 = c.add_request(x, greedy(stop=["CD"]), request_id="R3")
    outs = drain(c)
    done = {o.request_id: o for out in outs for o in out.finished}
    one, two = done[r1].outputs[0], done[r2].outputs[0]
    # R1: stop "DE" inside token "DEF": text "ABC", finish stop, 2 tokens consumed
    assert (one.text, one.finish_reason, one.stop_reason) == ("ABC", "stop", "DE")
    assert one.token_ids == [i[b"ABC"], i[b"DEF"]]
    # R2: stop "CD" across the "ABC"|"DEF" boundary
    assert (two.text, two.finish_reason, two.stop_reason) == ("AB", "stop", "CD")
    assert len(two.token_ids) == 2
    # R3, streamed: the chunks are exactly "AB" then nothing; "C" was never shown
    chunks = [d.text for out in outs for d in out.deltas if d.request_id == r3]
    assert "".join(chunks) == "AB" and all("C" not in chunk for chunk in chunks)
    # each finished with status STOP in the step that found its string (not an abort); every page came back
    stopped = {rid: reason for out in outs for rid, reason in out.record.finished.items()}
    assert stopped == dict.fromkeys(["R1", "R2", "R3"], m16.FinishReason.STOP)
    assert not any(out.record.aborted for out in outs)
    assert [e["state"] for e in c.summary()] == ["FINISHED"] * 3
    c.check_pages()
    assert c.stats().pages.private == 0


def test_bc19_streamed_prefix_never_retracted_when_no_stop_follows(toy) -> None:
    loaded, i = toy
    c = core(loaded)
    rid = c.add_request([i[b"X"]], greedy(max_tokens=4, stop=["CDX", "GHIJ"]))
    outs = drain(c)
    chunks = [d.text for out in outs for d in out.deltas if d.request_id == rid]
    # held back: "C" (it may start "CDX"), then "GHI" (it may start "GHIJ"); the end releases the rest
    assert chunks == ["AB", "CDEF", "", "GHIABC"]
    (final,) = [o for out in outs for o in out.finished]
    assert final.outputs[0].text == "ABCDEFGHIABC" and final.outputs[0].finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(toy) -> None:
    loaded, i = toy
    c = core(loaded)
    c.add_request([i[b"X"]], greedy(stop=["AB"], min_tokens=2))
    (out,) = [o for step in drain(c) for o in step.finished]
    assert out.outputs[0].text == "ABCDEFGHI" and len(out.outputs[0].token_ids) == 4


def test_include_stop_str_in_output(toy) -> None:
    loaded, i = toy
    c = core(loaded)
    c.add_request([i[b"X"]], greedy(stop=["EF"], include_stop_str_in_output=True))
    (out,) = [o for step in drain(c) for o in step.finished]
    assert (out.outputs[0].text, out.outputs[0].stop_reason) == ("ABCDEF", "EF")


def test_multi_byte_characters_are_never_streamed_half_way(toy) -> None:
    loaded, i = toy
    c = core(loaded)
    rid = c.add_request([i[b"Y"]], greedy(max_tokens=9))
    outs = drain(c)
    chunks = [d.text for out in outs for d in out.deltas if d.request_id == rid]
    # 9 tokens: é (2 bytes), € (3), é (2), then 2 of €'s 3 bytes: held while they might complete
    assert chunks == ["", "é", "", "", "€", "", "é", "", "\ufffd"]
    (final,) = [o for out in outs for o in out.finished]
    assert final.outputs[0].text == "é€é\ufffd"  # the model really ended inside a character: shown at the end


def test_eos_and_stop_ids_finish_with_their_own_reason(toy, tmp_path: Path) -> None:
    loaded, i = toy
    eos_model = rigged(tmp_path, loaded.tokenizer, {i[b"X"]: i[b"ABC"], i[b"ABC"]: 0}, eos=[0])
    c = core(eos_model)
    c.add_request([i[b"X"]], greedy())
    (out,) = [o for step in drain(c) for o in step.finished]
    eos = out.outputs[0]
    assert (eos.text, eos.token_ids, eos.finish_reason, eos.stop_reason) == ("ABC", [i[b"ABC"], 0], "stop", None)
    c = core(loaded)
    c.add_request([i[b"X"]], greedy(stop_token_ids=[i[b"GHI"]], logprobs=1))
    (out,) = [o for step in drain(c) for o in step.finished]
    stop = out.outputs[0]
    assert (stop.text, stop.finish_reason, stop.stop_reason) == ("ABCDEF", "stop", i[b"GHI"])
    assert [next(iter(lp)) for lp in stop.logprobs] == stop.token_ids == [i[b"ABC"], i[b"DEF"], i[b"GHI"]]
    c.check_pages()


def test_a_stop_string_cuts_ids_and_logprobs_together(toy) -> None:
    loaded, i = toy
    c = core(loaded, spec_len=3)  # prompt lookup proposes the cycle, so one step appends several ids
    c.add_request([i[b"X"], i[b"ABC"], i[b"DEF"], i[b"GHI"], i[b"ABC"]], greedy(max_tokens=12, stop=["IA"], logprobs=0))
    outs = drain(c)
    (out,) = [o for step in outs for o in step.finished]
    done = out.outputs[0]
    assert done.text == "DEFGH" and done.token_ids == [i[b"DEF"], i[b"GHI"], i[b"ABC"]]
    assert [next(iter(lp)) for lp in done.logprobs] == done.token_ids
    assert done.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(done.token_ids, done.logprobs)))
    assert any(sum(len(ids) for ids in step.record.tokens.values()) > 1 for step in outs)
    c.check_pages()
