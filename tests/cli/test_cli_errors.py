"""Every bad input is one ``mechserve: error: ...`` line on stderr and exit status 2, never a traceback (D3, D4)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_support import DATA, assert_one_error_line, load_example


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
    assert line == 'mechserve: error: requests[2].max_new_tokens: must be an integer > 0, got "x"'


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


@pytest.mark.parametrize(("field", "value"), [("prompt_len", 0), ("max_new_tokens", 0), ("max_new_tokens", -3)])
def test_request_size_not_positive(cli, spec_file, field: str, value: int) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(**{field: value})]})
    assert_one_error_line(result, f"requests[0].{field}", "> 0")


def test_empty_token_list(cli, spec_file) -> None:
    result = run_spec(cli, spec_file, {"requests": [request(tokens=[], prompt_len=None)]})
    assert_one_error_line(result, "requests[0].tokens")


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
    assert_one_error_line(cli(*command, "--mech", "m12"), "unknown rung", '"m12"', "m11_parallelism")


@pytest.mark.parametrize(
    ("mech", "workload", "needle"),
    [
        ("m05", {"engine": {"spec_len": 2}, "requests": [request()]}, "spec_len"),
        ("m08", {"requests": [request(accept_script=[1])]}, "accept_script"),
        ("m10", {"engine": {"world_size": 2}, "requests": [request()]}, "world_size"),
    ],
)
def test_rung_cannot_take_the_workload(cli, spec_file, mech: str, workload: Any, needle: str) -> None:
    assert_one_error_line(run_spec(cli, spec_file, workload, "--mech", mech), mech, needle)


def test_engine_error_part_way_prints_completed_steps(cli, spec_file) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    result = run_spec(cli, spec_file, example["workload"])
    assert_one_error_line(result, "Irreducible", "step 2", "big")
    steps = result.json_lines()
    assert [step["step"] for step in steps] == [0, 1]
    assert all("summary" not in step for step in steps)


def test_never_fits_on_m02(cli) -> None:
    result = cli("run", "--mech", "m02", "--request", "big:9:1", "--request", "small:2:1", "--json")
    line = assert_one_error_line(result, "RuntimeError", "never fits", "big")
    assert "after step 1" in line
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
    workload = {"requests": [request(), request(request_id="b", max_new_tokens=0)]}
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
