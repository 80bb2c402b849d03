"""Every bad input is one ``mechserve: error: ...`` line on stderr and exit status 2, never a traceback (D3, D4)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_support import DATA, assert_one_error_line, load_example

from mechserve.spec import RUNGS


def request(**fields: Any) -> dict[str, Any]:
    return {"request_id": "a", "prompt_len": 4, "max_new_tokens": 2, **fields}


def run_spec(cli, spec_file, workload: Any, *extra: str):
    return cli("run", "--spec", spec_file(workload), "--json", *extra)


def test_malformed_json(cli, spec_file) -> None:
    result = run_spec(cli, spec_file, '{"requests": [')
    assert_one_error_line(result, "malformed JSON")
    assert result.out == ""


def test_malformed_json_on_stdin(cli) -> None:
    assert_one_error_line(cli("run", "--spec", "-", stdin="{nope"), "stdin", "malformed JSON")


def test_repeated_key_in_one_object(cli, spec_file) -> None:
    assert_one_error_line(run_spec(cli, spec_file, '{"requests": [], "requests": []}'), '"requests"', "twice")


@pytest.mark.parametrize("top", ["[]", '"x"', "3", "null", "true"])
def test_top_level_not_an_object(cli, spec_file, top: str) -> None:
    assert_one_error_line(run_spec(cli, spec_file, top), "JSON object", top)


def test_unknown_top_level_key(cli, spec_file) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"requests": [], "engnie": {}}), '"engnie"', "unknown key")


def test_unknown_engine_key(cli, spec_file) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"engine": {"block_size": 4}}), "engine", '"block_size"')


def test_unknown_request_key(cli, spec_file) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(), request(request_id="b", prompt=[1])]})
    assert_one_error_line(result, "requests[1]", '"prompt"')


@pytest.mark.parametrize("engine", [[], "x"])
def test_engine_not_an_object(cli, spec_file, engine: Any) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"engine": engine}), "engine")


@pytest.mark.parametrize("requests", [{}, "a", 3])
def test_requests_not_a_list(cli, spec_file, requests: Any) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"requests": requests}), "requests: must be a list")


def test_request_not_an_object(cli, spec_file) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"requests": [request(), 7]}), "requests[1]")


def test_duplicate_request_ids(cli, spec_file) -> None:
    workload = {"requests": [request(), request(request_id="b"), request()]}
    assert_one_error_line(run_spec(cli, spec_file, workload), "requests[2]", "duplicate", '"a"', "requests[0]")


def test_duplicate_request_flags(cli) -> None:
    assert_one_error_line(cli("run", "--request", "a:1:1", "--request", "a:2:2"), "duplicate", '"a"')


def test_tokens_disagree_with_prompt_len(cli, spec_file) -> None:
    workload = {"requests": [request(tokens=[1, 2, 3], prompt_len=4)]}
    assert_one_error_line(run_spec(cli, spec_file, workload), "requests[0]", "prompt_len 4", "3 tokens")


def test_missing_prompt(cli, spec_file) -> None:
    workload = {"requests": [{"request_id": "a", "max_new_tokens": 2}]}
    assert_one_error_line(run_spec(cli, spec_file, workload), "requests[0]", "missing prompt")


@pytest.mark.parametrize("missing", ["request_id", "max_new_tokens"])
def test_missing_required_field(cli, spec_file, missing: str) -> None:
    req = request()
    del req[missing]
    assert_one_error_line(run_spec(cli, spec_file, {"requests": [req]}), "requests[0]", missing)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", "x"),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", True),
        ("max_new_tokens", None),
        ("prompt_len", "4"),
        ("prompt_len", 4.5),
        ("arrival_step", "1"),
        ("eos_after", False),
        ("eos_after", 1.5),
        ("tokens", "1 2 3"),
        ("tokens", [1, "2"]),
        ("tokens", [1, True]),
        ("accept_script", 1),
        ("accept_script", [1, 2.0]),
        ("request_id", None),
        ("request_id", ["a"]),
    ],
)
def test_non_integer_request_value(cli, spec_file, field: str, value: Any) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(**{field: value})]})
    assert_one_error_line(result, f"requests[0].{field}")


def test_non_integer_message_names_the_value(cli, spec_file) -> None:
    workload = {"requests": [request(), request(request_id="b"), request(request_id="c", max_new_tokens="x")]}
    line = assert_one_error_line(run_spec(cli, spec_file, workload))
    assert line == 'mechserve: error: requests[2].max_new_tokens: must be an integer >= 0, got "x"'


@pytest.mark.parametrize("name", ["max_step_tokens", "page_size", "num_pages", "spec_len", "world_size"])
@pytest.mark.parametrize("value", ["8", 2.0, True, None])
def test_non_integer_engine_value(cli, spec_file, name: str, value: Any) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"engine": {name: value}}), f"engine.{name}")


@pytest.mark.parametrize("field", ["arrival_step", "eos_after"])
def test_negative_arrival_or_eos_after(cli, spec_file, field: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(**{field: -1})]})
    assert_one_error_line(result, f"requests[0].{field}", ">= 0", "-1")


@pytest.mark.parametrize("field", ["ARRIVAL", "EOS_AFTER"])
def test_negative_arrival_or_eos_after_flag(cli, field: str) -> None:
    flag = "a:4:2:-1" if field == "ARRIVAL" else "a:4:2:0:-1"
    assert_one_error_line(cli("run", "--request", flag), "--request", ">= 0")


@pytest.mark.parametrize(("field", "value", "bound"), [("prompt_len", 0, "> 0"), ("max_new_tokens", -3, ">= 0")])
def test_request_size_out_of_range(cli, spec_file, field: str, value: int, bound: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(**{field: value})]})
    assert_one_error_line(result, f"requests[0].{field}", bound)


@pytest.mark.parametrize("mech", ["m00", "m05", "m11"])
def test_zero_max_new_tokens_below_m12(cli, spec_file, mech: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(max_new_tokens=0)]}, "--mech", mech)
    assert_one_error_line(result, f"{mech} has no admission control", '"a"', "max_new_tokens 0", "m12 or later")
    assert result.out == ""


@pytest.mark.parametrize("mech", ["m08", "m11"])
def test_empty_token_list_below_m12(cli, spec_file, mech: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(tokens=[], prompt_len=None)]}, "--mech", mech)
    assert_one_error_line(result, f"{mech} has no admission control", "empty prompt", "m12 or later")


def test_zero_tokens_and_empty_prompt_reach_m12s_door(cli, spec_file) -> None:
    """BC25/BC26: m12 finishes a zero-token request at admission and rejects an empty prompt, in the trace."""
    workload = {
        "requests": [
            request(request_id="zero", max_new_tokens=0),
            request(request_id="empty", tokens=[], prompt_len=None, max_new_tokens=5),
            request(request_id="ok", max_new_tokens=3),
        ]
    }
    result = run_spec(cli, spec_file, workload)
    assert result.code == 0, result.err
    *steps, summary = result.json_lines()
    assert steps[0]["rejected"] == [["empty", "EMPTY_PROMPT"]]
    assert steps[0]["admitted"] == ["zero", "ok"] and steps[0]["finished"]["zero"] == "LENGTH"
    assert "zero" not in steps[0]["scheduled"]
    states = {s["request_id"]: (s["state"], s["generated"]) for s in summary["summary"]}
    assert states == {"zero": ("FINISHED", 0), "empty": ("REJECTED", 0), "ok": ("FINISHED", 3)}


def test_zero_tokens_flag_on_m12(cli) -> None:
    result = cli("run", "--request", "a:4:0", "--json")
    assert result.code == 0, result.err
    assert result.json_lines()[0]["finished"] == {"a": "LENGTH"}


@pytest.mark.parametrize("name", ["max_step_tokens", "page_size", "num_pages", "world_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_engine_size_not_positive(cli, spec_file, name: str, value: int) -> None:
    result = run_spec(cli, spec_file, {"engine": {name: value}, "requests": [request()]})
    assert_one_error_line(result, f"engine.{name}", "> 0")


def test_negative_spec_len(cli, spec_file) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"engine": {"spec_len": -1}}), "engine.spec_len", ">= 0")


@pytest.mark.parametrize("flag", ["--max-step-tokens", "--page-size", "--num-pages", "--world-size"])
def test_engine_flag_zero_overrides_then_fails(cli, spec_file, flag: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request()]}, flag, "0")
    assert_one_error_line(result, flag, "> 0", "got 0")


def test_engine_flag_not_an_integer(cli) -> None:
    assert_one_error_line(cli("run", "--request", "a:1:1", "--num-pages", "many"), "--num-pages", "many")


def test_both_spec_and_request(cli, spec_file) -> None:
    result = cli("run", "--spec", spec_file({"requests": []}), "--request", "a:1:1")
    assert_one_error_line(result, "--spec", "--request", "not both")


def test_neither_spec_nor_request(cli) -> None:
    assert_one_error_line(cli("run", "--json"), "--spec", "--request")


@pytest.mark.parametrize("flag", ["a:4", "a:4:2:0:1:9", "a", ""])
def test_request_flag_with_wrong_field_count(cli, flag: str) -> None:
    assert_one_error_line(cli("run", "--request", flag), "--request", "3 to 5 fields")


@pytest.mark.parametrize("flag", ["a:x:2", "a:4:2.5", "a:4:2:soon"])
def test_request_flag_not_an_integer(cli, flag: str) -> None:
    assert_one_error_line(cli("run", "--request", flag), "--request", "must be an integer")


def test_request_flag_empty_id(cli) -> None:
    assert_one_error_line(cli("run", "--request", ":4:2"), "request_id")


def test_missing_spec_file(cli, tmp_path) -> None:
    assert_one_error_line(cli("run", "--spec", str(tmp_path / "absent.json")), "cannot read", "absent.json")


@pytest.mark.parametrize("command", [["run", "--request", "a:1:1"], ["demo"]])
def test_unknown_rung(cli, command: list[str]) -> None:
    assert_one_error_line(cli(*command, "--mech", "m17"), "unknown rung", '"m17"', "m00 .. m16", RUNGS[-1])


@pytest.mark.parametrize(
    ("mech", "workload", "needle"),
    [
        ("m05", {"engine": {"spec_len": 2}, "requests": [request()]}, "spec_len"),
        ("m08", {"requests": [request(accept_script=[1])]}, "accept_script"),
        ("m10", {"engine": {"world_size": 2}, "requests": [request()]}, "world_size"),
        ("m11", {"engine": {"max_waiting": 2}, "requests": [request()]}, "max_waiting 2 needs m12"),
        ("m11", {"engine": {"max_running": 1}, "requests": [request()]}, "max_running 1 needs m12"),
        ("m04", {"engine": {"max_model_len": 9}, "requests": [request()]}, "max_model_len 9 needs m12"),
        ("m11", {"requests": [request(stop_token_ids=[3])]}, "stop_token_ids"),
        ("m12", {"engine": {"output_caching": True}, "requests": [request()]}, "output_caching true needs m13"),
        ("m03", {"engine": {"output_caching": True}, "requests": [request()]}, "m03 has no output caching"),
        # issue 31: a script for a verifier that never runs (spec_len 0) was silently ignored from m09 on
        (
            "m09",
            {"requests": [request(accept_script=[1])]},
            'request "a" has an accept_script but engine.spec_len is 0',
        ),
        ("m14", {"requests": [request(accept_script=[0, 1])]}, "accept_script but engine.spec_len is 0"),
        ("m07", {"engine": {"prefix_caching": True}, "requests": [request()]}, "prefix_caching true needs m08"),
        ("m02", {"engine": {"prefix_caching": True}, "requests": [request()]}, "m02 has no prefix caching"),
        ("m11", {"engine": {"hold_shared_prefix": True}, "requests": [request()]}, "hold_shared_prefix true needs m12"),
        ("m08", {"engine": {"hold_shared_prefix": True}, "requests": [request()]}, "m08 has no shared-prefix hold"),
    ],
)
def test_rung_cannot_take_the_workload(cli, spec_file, mech: str, workload: Any, needle: str) -> None:
    assert_one_error_line(run_spec(cli, spec_file, workload, "--mech", mech), mech, needle)


@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        (
            {"prefix_caching": False, "hold_shared_prefix": True},
            "engine.hold_shared_prefix: true needs prefix caching, but engine.prefix_caching is false",
        ),
        (
            {"prefix_caching": False, "output_caching": True},
            "engine.output_caching: true needs prefix caching, but engine.prefix_caching is false",
        ),
        ({"prefix_caching": 1}, "engine.prefix_caching: must be true or false, got 1"),
        ({"hold_shared_prefix": "on"}, 'engine.hold_shared_prefix: must be true or false, got "on"'),
    ],
)
def test_prefix_cache_switches_are_booleans_that_need_prefix_caching(cli, spec_file, engine, needle: str) -> None:
    """A switch that acts only with prefix caching (the hold, output caching) given true beside
    ``prefix_caching`` false would do nothing: refused on every rung, like a switch that is not a boolean."""
    assert_one_error_line(run_spec(cli, spec_file, {"engine": engine, "requests": [request()]}), needle)


def test_engine_error_part_way_prints_completed_steps(cli, spec_file) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    result = run_spec(cli, spec_file, example["workload"], "--mech", "m11")
    assert_one_error_line(result, "Irreducible", "step 2", "big")
    steps = result.json_lines()
    assert [step["step"] for step in steps] == [0, 1]
    assert all("summary" not in step for step in steps)


def test_never_fits_on_m02(cli) -> None:
    result = cli("run", "--mech", "m02", "--request", "big:9:1", "--request", "small:2:1", "--json")
    line = assert_one_error_line(result, "never fits after step 1: ", "big")
    assert "RuntimeError" not in line
    steps = result.json_lines()
    assert [step["scheduled"] for step in steps] == [["small"], []]
    assert "summary" not in result.out


def test_out_of_pages_on_m03(cli) -> None:
    result = cli("run", "--mech", "m03", "--num-pages", "1", "--request", "a:4:3", "--json")
    assert_one_error_line(result, "OutOfPages", "step 1")
    assert len(result.json_lines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["run", "--bogus"],
        ["mechs", "extra"],
        ["diff", "m04"],
        ["demo", "--json", "--mech"],
    ],
)
def test_usage_errors_are_one_line(cli, argv: list[str]) -> None:
    result = cli(*argv)
    assert_one_error_line(result)
    assert "usage:" not in result.err + result.out


def test_spec_errors_come_before_any_output(cli, spec_file) -> None:
    workload = {"requests": [request(), request(request_id="b", max_new_tokens=-1)]}
    result = run_spec(cli, spec_file, workload)
    assert_one_error_line(result)
    assert result.out == ""


def test_null_optional_fields_are_absent(cli, spec_file) -> None:
    workload = {
        "engine": {"max_step_tokens": 8},
        "requests": [request(arrival_step=None, eos_after=None, accept_script=None, tokens=None)],
    }
    result = run_spec(cli, spec_file, workload)
    assert result.code == 0, result.err
    assert json.loads(result.lines[-1])["summary"][0]["generated"] == 2


# ---- m12's admission settings and stop ids (D4) ----------------------------------------------------------


@pytest.mark.parametrize("name", ["max_waiting", "max_running", "max_model_len"])
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_admission_setting_must_be_a_positive_integer(cli, spec_file, name: str, value: Any) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"engine": {name: value}}), f"engine.{name}", "> 0")


@pytest.mark.parametrize("flag", ["--max-waiting", "--max-running", "--max-model-len"])
def test_admission_flag_zero_fails(cli, flag: str) -> None:
    assert_one_error_line(cli("run", "--request", "a:1:1", flag, "0"), flag, "> 0", "got 0")


def test_admission_settings_reach_the_engine(cli, spec_file) -> None:
    requests = [request(request_id=rid, prompt_len=2, max_new_tokens=2) for rid in "abcd"]
    workload = {"engine": {"max_waiting": 2, "max_running": 1}, "requests": requests}
    *steps, _ = run_spec(cli, spec_file, workload).json_lines()
    assert steps[0]["rejected"] == [["c", "OVERLOADED"], ["d", "OVERLOADED"]]
    assert steps[0]["admitted"] == ["a"]
    flags = cli("run", "--request", "a:4:4", "--max-model-len", "7", "--json")
    assert flags.json_lines()[0]["rejected"] == [["a", "TOO_LONG"]]
    null = run_spec(cli, spec_file, {"engine": {"max_waiting": None}, "requests": [request()]})
    assert null.code == 0, null.err


def test_stop_token_ids_finish_with_stop(cli, spec_file) -> None:
    first = run_spec(cli, spec_file, {"requests": [request(max_new_tokens=5)]}).json_lines()[0]["tokens"]["a"][0]
    *steps, summary = run_spec(
        cli, spec_file, {"requests": [request(max_new_tokens=5, stop_token_ids=[first])]}
    ).json_lines()
    assert steps[0]["sampled"] == {"a": "STOP"} and steps[0]["finished"] == {"a": "STOP"}
    assert summary["summary"][0]["finish_reason"] == "STOP"


@pytest.mark.parametrize("value", [3, [1, -1], [1, "2"], [2**31], [True]])
def test_bad_stop_token_ids(cli, spec_file, value: Any) -> None:
    assert_one_error_line(run_spec(cli, spec_file, {"requests": [request(stop_token_ids=value)]}), "stop_token_ids")


# ---- limits: huge values are refused before anything is allocated -------------------------------------------


def test_huge_num_pages_flag(cli) -> None:
    result = cli("run", "--request", "a:1:1", "--num-pages", "1000000000000")
    assert_one_error_line(result, "--num-pages", "at most 1000000", "1000000000000")
    assert result.out == ""


@pytest.mark.parametrize(
    ("workload", "needles"),
    [
        ({"requests": [request(prompt_len=10**9)]}, ("requests[0].prompt_len", "at most 1000000")),
        ({"engine": {"world_size": 10**12}}, ("engine.world_size", "at most 64")),
        ({"engine": {"page_size": 10**12}}, ("engine.page_size", "at most 65536")),
        ({"engine": {"num_pages": 10**6 + 1}}, ("engine.num_pages", "at most 1000000")),
        ({"engine": {"max_step_tokens": 10**6 + 1}}, ("engine.max_step_tokens", "at most 1000000")),
        ({"engine": {"spec_len": 65}}, ("engine.spec_len", "at most 64")),
        ({"engine": {"max_waiting": 10**6 + 1}}, ("engine.max_waiting", "at most 1000000")),
        ({"engine": {"max_running": 10**6 + 1}}, ("engine.max_running", "at most 1000000")),
        ({"engine": {"num_pages": 10**6, "page_size": 17}}, ("engine.num_pages", "engine.page_size", "16777216 slots")),
        ({"requests": [request(arrival_step=10**6 + 1)]}, ("requests[0].arrival_step", "at most 1000000")),
        ({"requests": [request(max_new_tokens=10**9 + 1)]}, ("requests[0].max_new_tokens", "at most 1000000000")),
        ({"requests": [request(tokens=[1, 2**31], prompt_len=None)]}, ("requests[0].tokens[1]", "2147483647")),
        (
            {"requests": [request(request_id=str(i), prompt_len=10**6) for i in range(5)]},
            ("requests[4]", "total more than 4000000 tokens"),
        ),
    ],
)
def test_values_over_their_limit(cli, spec_file, workload: Any, needles: tuple[str, ...]) -> None:
    result = run_spec(cli, spec_file, workload)
    assert_one_error_line(result, *needles)
    assert result.out == ""


def test_values_at_their_limit_are_taken(cli, spec_file) -> None:
    engine = {"num_pages": 10**6, "page_size": 16, "spec_len": 64, "world_size": 64, "max_waiting": 10**6}
    workload = {"engine": engine, "requests": [request(tokens=[2**31 - 1], prompt_len=None, max_new_tokens=10**9)]}
    result = run_spec(cli, spec_file, workload)
    assert result.code == 0, result.err
    assert result.json_lines()[0]["rejected"] == [["a", "NEVER_FITS"]]


def test_flag_slots_limit_names_the_flags(cli) -> None:
    result = cli("run", "--request", "a:1:1", "--num-pages", "1000000", "--page-size", "64")
    assert_one_error_line(result, "--num-pages 1000000", "--page-size 64", "16777216 slots")


@pytest.mark.parametrize("flag", ["a:1000000000:1", "a:1:1:1000000000", "a:1:10000000000", "a:" + "9" * 30 + ":1"])
def test_huge_request_flag_values(cli, flag: str) -> None:
    assert_one_error_line(cli("run", "--request", flag), "--request", "at most")


# ---- JSON that Python cannot convert is malformed JSON, not an internal error -------------------------------


def test_json_integer_with_too_many_digits(cli, spec_file) -> None:
    text = '{"requests": [{"request_id": "a", "prompt_len": ' + "9" * 5000 + ', "max_new_tokens": 1}]}'
    line = assert_one_error_line(run_spec(cli, spec_file, text), "malformed JSON", "digits")
    assert "internal error" not in line


def test_json_nested_too_deeply(cli) -> None:
    line = assert_one_error_line(cli("run", "--spec", "-", stdin="[" * 100_000), "stdin", "malformed JSON", "nested")
    assert "internal error" not in line


# ---- request ids --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rid", ["a\nb", "esc\x1b[31m", "tab\there", "nul\x00", "line\u2028sep", "\x7f"])
def test_request_id_with_control_characters(cli, spec_file, rid: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(request_id=rid)]})
    assert_one_error_line(result, "requests[0].request_id", "control characters")


@pytest.mark.parametrize("rid", [" a", "a ", "\u00a0a", " "])
def test_request_id_with_surrounding_whitespace(cli, spec_file, rid: str) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(request_id=rid)]})
    assert_one_error_line(result, "requests[0].request_id", "whitespace")


@pytest.mark.parametrize(
    ("flag", "needle"),
    [("a\nb:4:2", "control characters"), ("\x1b:4:2", "control"), (" a:4:2", "whitespace"), ("a :4:2", "whitespace")],
)
def test_request_flag_id_is_checked_too(cli, flag: str, needle: str) -> None:
    assert_one_error_line(cli("run", "--request", flag), "--request", "request_id", needle)


@pytest.mark.parametrize("rid", ["a b", "résumé", "r-0.1", "日本"])
def test_ordinary_request_ids_are_fine(cli, spec_file, rid: str) -> None:
    assert run_spec(cli, spec_file, {"requests": [request(request_id=rid)]}).code == 0


@pytest.mark.parametrize("env", ["MECHSERVE_ATTENTION", "MECHSERVE_LINEAR"])
def test_bad_kernel_mode_is_a_usage_error(cli, monkeypatch, env: str) -> None:
    """Refused before any work, even when the run would never reach a kernel (``--max-tokens 0``), so a
    server never comes up healthy and then fails every request (found by a new user's trial)."""
    monkeypatch.setenv(env, "gpu")
    for max_tokens in ("2", "0"):
        assert_one_error_line(
            cli("generate", "hi", "--max-tokens", max_tokens), f"{env} must be one of auto, native, torch", "'gpu'"
        )
    assert cli("generate", "--help").code == 0  # help and model-free commands do not care
    assert cli("mechs").code == 0


def test_bad_spec_costs_mode_is_a_usage_error(cli, monkeypatch) -> None:
    """``MECHSERVE_SPEC_COSTS`` (the governor's cost model) is checked as the kernel modes are: before any work."""
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "guessed")
    assert_one_error_line(
        cli("generate", "hi", "--max-tokens", "2", "--spec-method", "ngram"),
        "MECHSERVE_SPEC_COSTS must be one of measured, static",
        "'guessed'",
    )


def test_bad_suffix_tree_mode_is_a_usage_error(cli, monkeypatch) -> None:
    """``MECHSERVE_SUFFIX_TREE`` (suffix decoding's trees) is checked as the kernel modes are: before any work,
    whatever the speculation method."""
    monkeypatch.setenv("MECHSERVE_SUFFIX_TREE", "rust")
    assert_one_error_line(
        cli("generate", "hi", "--max-tokens", "2"),
        "MECHSERVE_SUFFIX_TREE must be one of auto, native, python",
        "'rust'",
    )


@pytest.mark.parametrize("env", ["MECHSERVE_ATTENTION", "MECHSERVE_LINEAR"])
def test_bad_kernel_mode_fails_the_engine_at_construction(monkeypatch, env: str) -> None:
    from mechserve.api.config import EngineConfig
    from mechserve.engine.core import EngineCore
    from mechserve.kv import native
    from mechserve.model import linear
    from mechserve.model.loader import load_model

    loaded = load_model("smollm2", tokenizer=False)
    monkeypatch.setenv(env, "gpu")
    native.enabled.cache_clear()
    linear.enabled.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"{env} must be one of"):
            EngineCore(loaded, EngineConfig(num_pages=8))
    finally:
        monkeypatch.delenv(env)
        native.enabled.cache_clear()
        linear.enabled.cache_clear()


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["generate", "caf\udce9"], ["argument 2", "caf\\xe9", "byte 0xe9"]),  # what $'caf\xe9' becomes in Latin-1
        (["generate", "hi", "--stop", "\udcff"], ["--stop", "byte 0xff"]),
        (["run", "--request", "a\ud800:4:2"], ["the value of --request", "U+D800"]),
    ],
)
def test_an_argument_that_is_not_utf8_is_one_line(cli, argv: list[str], needles: list[str]) -> None:
    """An undecodable byte reaches Python as a lone surrogate, which no tokenizer takes: refused before any work."""
    assert_one_error_line(cli(*argv), "not valid UTF-8", *needles)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--no-prefix-caching", "--hold-shared-prefix"], "--hold-shared-prefix: true needs prefix caching"),
        (["--no-prefix-caching", "--output-caching"], "but --prefix-caching is false"),
        (["--mech", "m07", "--prefix-caching"], "m07 has no prefix caching: prefix_caching true needs m08"),
        (["--mech", "m11", "--hold-shared-prefix"], "m11 has no shared-prefix hold"),
    ],
)
def test_switch_flags_refused_where_they_cannot_act(cli, flags: list[str], needle: str) -> None:
    assert_one_error_line(cli("run", "--request", "a:4:2", *flags), needle)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--api-key", ""],
        ["serve", "--api-key", "  "],
        ["router", "--worker-api-key", "", "--worker-urls", "http://a:1"],
    ],
)
def test_an_empty_api_key_is_refused_not_authentication_off(cli, argv: list[str]) -> None:
    assert_one_error_line(cli(*argv), argv[1], "an empty key would turn authentication off")


def test_an_empty_api_key_from_the_environment_is_refused(cli, monkeypatch) -> None:
    monkeypatch.setenv("MECHSERVE_API_KEY", "")
    assert_one_error_line(cli("serve"), "--api-key", "$MECHSERVE_API_KEY", "authentication off")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["generate", "hi", "--spec-method", "suffix", "--spec-len", "4", "--ngram-max", "7"],
            ["--ngram-max is an option of --spec-method ngram", "in use is suffix"],
        ),
        (
            ["serve", "--spec-method", "suffix", "--spec-len", "4", "--ngram-max", "3"],
            ["--ngram-max is an option of --spec-method ngram", "in use is suffix"],
        ),
        (
            ["generate", "hi", "--spec-method", "draft", "--draft-model", "smollm2:layers=1", "--ngram-min", "2"],
            ["--ngram-min is an option of --spec-method ngram", "in use is draft"],
        ),
        (
            ["generate", "hi", "--ngram-max", "5"],
            ["--ngram-max is an option of --spec-method ngram", "speculation is off"],
        ),
        (
            ["serve", "--suffix-decoding-max-tree-depth", "8"],
            ["--suffix-decoding-max-tree-depth is an option of --spec-method suffix", "speculation is off"],
        ),
        (["generate", "hi", "--spec-fixed"], ["--spec-fixed", "speculation is off"]),
        (["serve", "--spec-len", "0", "--spec-fixed"], ["--spec-fixed", "speculation is off"]),
        (["generate", "hi", "--spec-len", "2", "--ngram-min", "4"], ["--ngram-min 4 is more than --ngram-max 3"]),
    ],
)
def test_a_speculation_flag_of_a_method_not_in_use_is_refused(cli, argv: list[str], needles: list[str]) -> None:
    assert_one_error_line(cli(*argv, "--model", "/nonexistent"), *needles)
