"""``mechserve.workload``: parsing, synthetic prompts, rung names and building any rung's engine."""

from __future__ import annotations

import json

import pytest
from cli_support import DATA, load_example

from mechserve.spec import RUNGS
from mechserve.workload import (
    ENGINE_DEFAULTS,
    UnknownRung,
    WorkloadError,
    build_engine,
    fit_rung,
    load_rung,
    load_workload,
    parse_request_flag,
    parse_workload,
    rung_label,
    with_engine,
    workload_from_flags,
)


def test_defaults_fill_the_engine() -> None:
    assert parse_workload({}).engine == dict(ENGINE_DEFAULTS)
    assert dict(ENGINE_DEFAULTS) == {
        "max_step_tokens": 8,
        "page_size": 4,
        "num_pages": 8,
        "spec_len": 0,
        "world_size": 1,
    }
    assert parse_workload({"engine": {"page_size": 2}}).engine["page_size"] == 2


def test_synthetic_prompts_count_every_position() -> None:
    workload = parse_workload(
        {
            "requests": [
                {"request_id": "a", "prompt_len": 3, "max_new_tokens": 1},
                {"request_id": "b", "tokens": [7, 8], "max_new_tokens": 1},
                {"request_id": "c", "prompt_len": 2, "max_new_tokens": 1},
            ]
        }
    )
    assert [r.tokens for r in workload.requests] == [(0, 1, 2), (7, 8), (2000, 2001)]


def test_request_flags_get_synthetic_prompts() -> None:
    workload = workload_from_flags(["a:2:3", "b:3:1:4:0"])
    a, b = workload.requests
    assert (a.request_id, a.tokens, a.max_new_tokens, a.arrival_step, a.eos_after) == ("a", (0, 1), 3, 0, None)
    assert (b.tokens, b.arrival_step, b.eos_after) == ((1000, 1001, 1002), 4, 0)
    assert workload.engine == dict(ENGINE_DEFAULTS)
    assert parse_request_flag("x: 5:1", 0).prompt_len == 5  # fields go through int()


def test_integer_request_ids_pass_through_str() -> None:
    workload = parse_workload({"requests": [{"request_id": 7, "prompt_len": 1, "max_new_tokens": 1}]})
    assert workload.requests[0].request_id == "7"


def test_workload_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"requests\[0\]\.max_new_tokens"):
        parse_workload({"requests": [{"request_id": "a", "prompt_len": 1, "max_new_tokens": -1}]})


def test_load_workload_reports_position_of_bad_json() -> None:
    with pytest.raises(WorkloadError, match=r"spec\.json: malformed JSON: .*line 1 column"):
        load_workload("{", source="spec.json")


def test_with_engine_overrides_and_validates() -> None:
    workload = with_engine(parse_workload({"engine": {"num_pages": 3}}), {"num_pages": 5})
    assert workload.engine["num_pages"] == 5
    with pytest.raises(WorkloadError, match="--num-pages: must be an integer > 0, got 0"):
        with_engine(workload, {"num_pages": 0}, {"num_pages": "--num-pages"})


@pytest.mark.parametrize("spelling", ["m05", "5", "05", "m05_preemption", "M05", " m5 "])
def test_load_rung_spellings(spelling: str) -> None:
    rung = load_rung(spelling)
    assert rung.__name__ == "mechserve.spec.m05_preemption"
    assert rung_label(rung) == "m05"


@pytest.mark.parametrize("spelling", ["m17", "17", "preemption", "", "m05_preempt", "-1"])
def test_load_rung_unknown(spelling: str) -> None:
    with pytest.raises(UnknownRung, match=r"m00 \.\. m16: m00_engine_loop.*m15_routing, m16_request_draft_lengths"):
        load_rung(spelling)


def test_load_rung_top() -> None:
    assert load_rung("m16") is load_rung(RUNGS[-1]) is load_rung("16")


def test_unknown_rung_is_a_workload_error() -> None:
    assert issubclass(UnknownRung, WorkloadError)


@pytest.mark.parametrize("name", RUNGS)
def test_build_engine_on_every_rung(name: str) -> None:
    rung = load_rung(name)
    workload = parse_workload(
        {
            "engine": {"max_step_tokens": 16, "num_pages": 16},
            "requests": [
                {"request_id": "a", "tokens": [1, 2, 3, 4, 5], "max_new_tokens": 2},
                {"request_id": "b", "prompt_len": 3, "max_new_tokens": 3, "arrival_step": 1, "eos_after": 1},
            ],
        }
    )
    engine = build_engine(rung, workload)
    engine.run()
    summary = engine.summary()
    assert [s["finish_reason"] for s in summary] == ["LENGTH", "EOS"]
    assert [s["generated"] for s in summary] == [2, 1]
    assert summary[0]["computed"] == 6  # 5 prompt tokens (the tokens' length below m08) + 2 - 1


def test_build_engine_gives_each_engine_its_own_scripts() -> None:
    rung = load_rung("m09")
    workload = parse_workload(
        {
            "engine": {"spec_len": 2},
            "requests": [{"request_id": "a", "prompt_len": 2, "max_new_tokens": 6, "accept_script": [0, 0]}],
        }
    )
    first = build_engine(rung, workload)
    first.run()
    assert first.requests[0].accept_script == []  # m09 consumes the request's own list
    assert workload.requests[0].accept_script == (0, 0)
    second = build_engine(rung, workload)
    assert [r.to_json() for r in second.run()] == [r.to_json() for r in build_engine(rung, workload).run()]


@pytest.mark.parametrize(
    ("name", "engine", "script", "needle"),
    [
        ("m08", {"spec_len": 1}, None, "spec_len 1 needs m09"),
        ("m00", {"spec_len": 3}, None, "spec_len"),
        ("m05", {}, [1], "accept_script"),
        ("m10", {"world_size": 4}, None, "world_size 4 needs m11"),
    ],
)
def test_rung_without_the_feature_rejects_the_workload(name, engine, script, needle) -> None:
    request = {"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, "accept_script": script}
    workload = parse_workload({"engine": engine, "requests": [request]})
    with pytest.raises(WorkloadError, match=needle):
        build_engine(load_rung(name), workload)


def test_empty_accept_script_is_allowed_on_every_rung() -> None:
    request = {"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, "accept_script": []}
    build_engine(load_rung("m00"), parse_workload({"requests": [request]})).run()


def test_fit_rung_drops_what_the_rung_lacks() -> None:
    demo = parse_workload(load_example(DATA / "demo.json")["workload"])
    fitted, notes = fit_rung(load_rung("m05"), demo)
    assert fitted.engine["spec_len"] == 0 and fitted.engine["world_size"] == 1
    assert all(r.accept_script is None for r in fitted.requests)
    assert len(notes) == 2
    assert fit_rung(load_rung("m11"), demo) == (demo, ())
    assert fit_rung(load_rung("m12"), demo) == (demo, ())
    fitted, notes = fit_rung(load_rung("m09"), demo)
    assert fitted.engine["spec_len"] == 3 and notes == ("m09 has no parallelism: running with world_size 1",)


def test_explicit_tokens_reduce_to_their_length_below_m08() -> None:
    with_tokens = {"requests": [{"request_id": "a", "tokens": [9, 9, 9], "max_new_tokens": 2}]}
    with_len = {"requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 2}]}
    rung = load_rung("m07")
    traces = [[r.to_json() for r in build_engine(rung, parse_workload(w)).run()] for w in (with_tokens, with_len)]
    assert traces[0] == traces[1]


def test_every_example_workload_parses() -> None:
    """Each worked example's workload parses into what it says: its engine values over the defaults, its
    requests in order with their fields (a parser that drops or renames one fails here)."""
    examples = sorted((DATA / "examples").glob("*.json"))
    assert len(examples) >= 10
    for path in examples:
        raw = json.loads(path.read_text())["workload"]
        w = parse_workload(raw)
        assert w.engine == {**ENGINE_DEFAULTS, **(raw.get("engine") or {})}, path.name
        assert [r.request_id for r in w.requests] == [str(r["request_id"]) for r in raw["requests"]], path.name
        for req, spec in zip(w.requests, raw["requests"]):
            assert req.max_new_tokens == spec["max_new_tokens"], path.name
            assert req.arrival_step == spec.get("arrival_step", 0) and req.eos_after == spec.get("eos_after")
            if "tokens" in spec:
                assert list(req.tokens) == spec["tokens"]
            else:
                assert len(req.tokens) == spec["prompt_len"]
            script = spec.get("accept_script")
            assert req.accept_script == (None if script is None else tuple(script))


def test_admission_settings_are_absent_by_default() -> None:
    assert "max_waiting" not in parse_workload({}).engine
    engine = parse_workload({"engine": {"max_waiting": 3, "max_running": None, "max_model_len": 9}}).engine
    assert engine == {**ENGINE_DEFAULTS, "max_waiting": 3, "max_model_len": 9}
    assert with_engine(parse_workload({}), {"max_running": 2}).engine["max_running"] == 2


def test_admission_settings_and_stop_ids_reach_m12() -> None:
    workload = parse_workload(
        {
            "engine": {"max_waiting": 3, "max_running": 2, "max_model_len": 50},
            "requests": [{"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, "stop_token_ids": [5, 6]}],
        }
    )
    engine = build_engine(load_rung("m12"), workload)
    assert (engine.max_waiting, engine.max_running, engine.max_model_len) == (3, 2, 50)
    assert engine.requests[0].stop_token_ids == (5, 6)


def test_fit_rung_drops_admission_settings_below_m12() -> None:
    workload = parse_workload(
        {
            "engine": {"max_running": 2},
            "requests": [{"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, "stop_token_ids": [5]}],
        }
    )
    fitted, notes = fit_rung(load_rung("m11"), workload)
    assert "max_running" not in fitted.engine and fitted.requests[0].stop_token_ids == ()
    assert notes == ("m11 has no admission control: running without max_running, stop_token_ids",)
    build_engine(load_rung("m11"), fitted).run()


def test_the_output_caching_switch_is_a_json_boolean_for_m13() -> None:
    """``output_caching`` (m13): absent unless given, true or false only; m13 takes it, lower rungs refuse
    true (``check_rung``) and drop it with a note (``fit_rung``); false is allowed everywhere."""
    request = {"request_id": "a", "prompt_len": 6, "max_new_tokens": 9}
    plain = parse_workload({"requests": [request]})
    assert "output_caching" not in plain.engine and build_engine(load_rung("m13"), plain).output_caching is False
    on = parse_workload({"engine": {"output_caching": True}, "requests": [request]})
    assert on.engine["output_caching"] is True
    engine = build_engine(load_rung("m13"), on)
    assert engine.output_caching is True and sum(sum(t.published.values()) for t in engine.run()) == 3
    for bad in (1, 0, "true", [True]):
        with pytest.raises(WorkloadError, match=r"engine\.output_caching: must be true or false"):
            parse_workload({"engine": {"output_caching": bad}})
    assert "output_caching" not in parse_workload({"engine": {"output_caching": None}}).engine
    with pytest.raises(WorkloadError, match="m12 has no output caching: output_caching true needs m13 or later"):
        build_engine(load_rung("m12"), on)
    off = parse_workload({"engine": {"output_caching": False}, "requests": [request]})
    build_engine(load_rung("m05"), off).run()
    fitted, notes = fit_rung(load_rung("m12"), on)
    assert "output_caching" not in fitted.engine and notes == (
        "m12 has no output caching: running without output_caching",
    )
    assert fit_rung(load_rung("m12"), off)[1] == ()
    assert with_engine(plain, {"output_caching": True}).engine["output_caching"] is True
    with pytest.raises(WorkloadError, match="--output-caching: must be true or false"):
        with_engine(plain, {"output_caching": 3}, {"output_caching": "--output-caching"})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens 0"),
        ({"tokens": [], "prompt_len": None}, "empty prompt"),
        ({"stop_token_ids": [1]}, "stop_token_ids"),
    ],
)
def test_m12_only_request_values_below_m12(extra, needle) -> None:
    workload = parse_workload({"requests": [{"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, **extra}]})
    build_engine(load_rung("m12"), workload).run()
    build_engine(load_rung("m13"), workload).run()
    for name in RUNGS[: RUNGS.index("m12_admission_control")]:
        with pytest.raises(WorkloadError, match=f"{name[:3]} has no admission control: .*{needle}"):
            build_engine(load_rung(name), workload)


def test_empty_stop_list_is_allowed_on_every_rung() -> None:
    request = {"request_id": "a", "prompt_len": 2, "max_new_tokens": 1, "stop_token_ids": []}
    build_engine(load_rung("m00"), parse_workload({"requests": [request]})).run()


def test_total_prompt_tokens_are_bounded_while_parsing() -> None:
    from mechserve.api.limits import MAX_TOTAL_PROMPT_TOKENS

    flags = [f"r{i}:1000000:1" for i in range(MAX_TOTAL_PROMPT_TOKENS // 1_000_000)]
    assert len(workload_from_flags(flags).requests) == len(flags)
    with pytest.raises(WorkloadError, match=r"--request \"x:1:1\": .*total more than"):
        workload_from_flags([*flags, "x:1:1"])


def spec_rungs(first: str) -> list[str]:
    """The rungs from ``first`` (``mNN``) to the top."""
    return [name for name in RUNGS if name[:3] >= first]


def shared_prefix_workload(**engine: object) -> dict:
    """p and r share two 4-token prompt blocks and arrive together; budget 16, pages of 4, pages for both."""
    return {
        "engine": {"max_step_tokens": 16, "page_size": 4, "num_pages": 16, **engine},
        "requests": [
            {"request_id": "p", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_new_tokens": 2},
            {"request_id": "r", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 10], "max_new_tokens": 2},
            {"request_id": "q", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 11], "max_new_tokens": 2, "arrival_step": 3},
        ],
    }


def test_accept_script_with_spec_len_0_is_refused_from_m09() -> None:
    """Issue 31: from m09 on an accept_script with spec_len 0 was accepted and never read (no window drafts);
    it is refused now, naming the request and the field, as m00-m08 refuse any accept_script."""
    scripted = {"request_id": "a", "prompt_len": 2, "max_new_tokens": 3, "accept_script": [1, 0]}
    workload = parse_workload({"requests": [scripted]})
    for name in spec_rungs("m09"):
        with pytest.raises(WorkloadError, match=r'request "a" has an accept_script but engine\.spec_len is 0'):
            build_engine(load_rung(name), workload)
        # spec_len > 0 takes the script; an empty script is no script
        build_engine(load_rung(name), with_engine(workload, {"spec_len": 1})).run()
        empty = parse_workload({"requests": [{**scripted, "accept_script": []}]})
        build_engine(load_rung(name), empty).run()
        # the demo path (fit_rung) drops it with a note instead, as it does below m09
        fitted, notes = fit_rung(load_rung(name), workload)
        assert fitted.requests[0].accept_script is None and notes == (
            "spec_len is 0: running without accept scripts (no window drafts a guess to accept)",
        )
    with pytest.raises(WorkloadError, match="m08 has no speculative decoding"):
        build_engine(load_rung("m08"), workload)


def reused_tokens(engine) -> int:
    return sum(sum(t.reused.values()) for t in engine.run())


def test_the_prefix_caching_switch_is_honoured_from_m08_and_refused_below() -> None:
    """``prefix_caching`` (m08's constructor switch, default on): absent unless given, a JSON boolean; false
    turns reuse and publishing off on m08 and every rung above; true below m08 is refused, naming the key and
    m08; false there is what those rungs do and is allowed."""
    default = parse_workload(shared_prefix_workload())
    assert "prefix_caching" not in default.engine
    off = parse_workload(shared_prefix_workload(prefix_caching=False))
    on = parse_workload(shared_prefix_workload(prefix_caching=True))
    for name in spec_rungs("m08"):
        rung = load_rung(name)
        assert build_engine(rung, default).prefix_caching is True and build_engine(rung, on).prefix_caching is True
        assert reused_tokens(build_engine(rung, on)) == reused_tokens(build_engine(rung, default)) > 0
        engine = build_engine(rung, off)
        assert engine.prefix_caching is False
        records = engine.run()
        assert sum(sum(t.reused.values()) for t in records) == 0 and not any(t.published for t in records)
    for name in RUNGS[: RUNGS.index("m08_cache_aware_scheduling")]:
        with pytest.raises(WorkloadError, match=f"{name[:3]} has no prefix caching: prefix_caching true needs m08"):
            build_engine(load_rung(name), on)
        build_engine(load_rung(name), off).run()
        fitted, notes = fit_rung(load_rung(name), on)
        assert (
            "prefix_caching" not in fitted.engine
            and notes[-1] == f"{name[:3]} has no prefix caching: running without prefix_caching"
        )
    with pytest.raises(WorkloadError, match=r"engine\.prefix_caching: must be true or false"):
        parse_workload({"engine": {"prefix_caching": "no"}})
    assert with_engine(default, {"prefix_caching": False}).engine["prefix_caching"] is False


def test_the_hold_shared_prefix_switch_is_honoured_from_m12_and_refused_below() -> None:
    """``hold_shared_prefix`` (m12's constructor switch, default off): true holds r until p has published the
    blocks they share, then r reuses them; below m12 true is refused, naming the key and m12."""
    plain = parse_workload(shared_prefix_workload())
    held = parse_workload(shared_prefix_workload(hold_shared_prefix=True))
    for name in spec_rungs("m12"):
        rung = load_rung(name)
        assert build_engine(rung, plain).hold_shared_prefix is False
        without = build_engine(rung, plain).run()
        assert without[0].admitted == ("p", "r")
        engine = build_engine(rung, held)
        assert engine.hold_shared_prefix is True
        records = engine.run()
        assert records[0].admitted == ("p",) and any("held" in line for line in records[0].explain)
        assert records[1].admitted == ("r",) and records[1].reused == {"r": 8}
        unheld = build_engine(rung, plain)
        unheld.run()
        assert [r.output_ids for r in engine.requests] == [r.output_ids for r in unheld.requests]  # N25
    for name in RUNGS[: RUNGS.index("m12_admission_control")]:
        with pytest.raises(
            WorkloadError, match=f"{name[:3]} has no shared-prefix hold: hold_shared_prefix true needs m12"
        ):
            build_engine(load_rung(name), held)
    build_engine(load_rung("m11"), parse_workload(shared_prefix_workload(hold_shared_prefix=False))).run()
    for switch in ("hold_shared_prefix", "output_caching"):
        with pytest.raises(WorkloadError, match=f"engine\\.{switch}: true needs prefix caching"):
            parse_workload(shared_prefix_workload(prefix_caching=False, **{switch: True}))
        with pytest.raises(WorkloadError, match=f"--{switch.replace('_', '-')}: true needs prefix caching"):
            labels = {switch: f"--{switch.replace('_', '-')}"}
            with_engine(parse_workload(shared_prefix_workload(prefix_caching=False)), {switch: True}, labels)


def test_run_honours_the_switches_in_the_spec_and_as_flags(cli, spec_file) -> None:
    path = spec_file(shared_prefix_workload())
    plain = cli("run", "--spec", path, "--json").json_lines()
    assert plain[0]["admitted"] == ["p", "r"] and any(step["reused"] for step in plain[:-1])
    for argv in (
        ["--spec", spec_file(shared_prefix_workload(prefix_caching=False))],
        ["--spec", path, "--no-prefix-caching"],
    ):
        steps = cli("run", *argv, "--json").json_lines()[:-1]
        assert not any(step["reused"] or step["published"] for step in steps)
    for argv in (
        ["--spec", spec_file(shared_prefix_workload(hold_shared_prefix=True))],
        ["--spec", path, "--hold-shared-prefix"],
    ):
        result = cli("run", *argv, "--json", "--mech", "m12")
        assert result.code == 0, result.err
        steps = result.json_lines()[:-1]
        assert [step["admitted"] for step in steps[:2]] == [["p"], ["r"]] and steps[1]["reused"] == {"r": 8}


def test_m13_m14_serve_issue_31_first_come_first_served(cli, spec_file) -> None:
    """Issue 31's reproducer through ``mechserve run``: on m12 and the rungs above (D9, m12's N27) early,
    listed last and arriving first, is scheduled at every step until it finishes; m11 starves it."""
    late = [{"request_id": f"r{i}", "prompt_len": 4, "max_new_tokens": 60, "arrival_step": i + 1} for i in range(50)]
    workload = {
        "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 2000},
        "requests": [*late, {"request_id": "early", "prompt_len": 4, "max_new_tokens": 60, "arrival_step": 0}],
    }
    path = spec_file(workload)
    for mech in ("m12", "m13", "m14"):
        steps = cli("run", "--spec", path, "--json", "--mech", mech).json_lines()[:-1]
        assert [s["step"] for s in steps if "early" in s["scheduled"]] == list(range(60)), mech
        assert steps[59]["finished"] == {"early": "LENGTH"}
    steps = cli("run", "--spec", path, "--json", "--mech", "m11").json_lines()[:-1]
    assert next(s["step"] for s in steps if "early" in s["finished"]) > 400
