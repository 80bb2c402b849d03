"""Every worked example and the demo, reproduced exactly through ``mechserve ... --json``.

The examples are m11 behaviour (example 07 raises ``Irreducible`` there), so they
pin ``--mech m11``; m12 must give the same contract fields on all of them except
07, where its door rejects ``big`` instead.  ``tests/data`` is the source of truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_support import CONTRACT_FIELDS, DATA, EXAMPLES, assert_one_error_line, load_example

# The examples' rung; m12 adds the door (``rejected``, ``aborted``) on top of it.
EXAMPLE_RUNG = "m11"
M12_EXTRA_FIELDS = ("tokens", "rejected", "aborted", "explain")
SAME_ON_M12 = [p for p in EXAMPLES if not p.name.startswith("07-")]


def contract_part(line: dict[str, Any]) -> dict[str, Any]:
    """The 13 contract fields of one JSON step line, checking that they come first and in order."""
    keys = list(line)
    assert keys[: len(CONTRACT_FIELDS)] == list(CONTRACT_FIELDS), keys
    assert set(keys[len(CONTRACT_FIELDS) :]) <= set(M12_EXTRA_FIELDS), keys
    return {key: line[key] for key in CONTRACT_FIELDS}


def split_output(lines: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Step lines and the summary (None when no summary line was printed)."""
    if lines and list(lines[-1]) == ["summary"]:
        return lines[:-1], lines[-1]["summary"]
    return lines, None


def test_examples_are_present() -> None:
    assert len(EXAMPLES) == 10
    assert (DATA / "demo.json").is_file()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_reproduced(path: Path, cli, spec_file) -> None:
    example = load_example(path)
    result = cli("run", "--spec", spec_file(example["workload"]), "--json", "--mech", EXAMPLE_RUNG)
    steps, summary = split_output(result.json_lines())
    assert [contract_part(step) for step in steps] == example["trace"]
    if "error" in example:
        assert_one_error_line(result, example["error"]["exception"], f"step {example['error']['raised_during_step']}")
        assert summary is None
        assert result.code == example["exit_status"]
    else:
        assert result.code == 0, result.err
        assert result.err == ""
        assert summary == example["summary"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_from_stdin(path: Path, cli) -> None:
    example = load_example(path)
    result = cli("run", "--spec", "-", "--json", "--mech", EXAMPLE_RUNG, stdin=json.dumps(example["workload"]))
    steps, _ = split_output(result.json_lines())
    assert [contract_part(step) for step in steps] == example["trace"]


def test_demo_json_matches(cli) -> None:
    demo = load_example(DATA / "demo.json")
    result = cli("demo", "--json", "--mech", EXAMPLE_RUNG)
    assert result.code == 0 and result.err == ""
    steps, summary = split_output(result.json_lines())
    assert [contract_part(step) for step in steps] == demo["trace"]
    assert summary == demo["summary"]


def test_demo_workload_is_the_documented_one(cli, spec_file) -> None:
    demo = load_example(DATA / "demo.json")
    assert cli("run", "--spec", spec_file(demo["workload"]), "--json").out == cli("demo", "--json").out


def test_json_lines_use_default_dumps_format(cli) -> None:
    result = cli("demo", "--json")
    for line in result.lines:
        assert line == json.dumps(json.loads(line))
        assert not line.endswith(" ")


def test_json_tokens_and_door_fields_follow_the_contract_fields(cli) -> None:
    steps, _ = split_output(cli("demo", "--json").json_lines())
    assert all(list(step)[len(CONTRACT_FIELDS) :] == ["tokens", "rejected", "aborted"] for step in steps)
    steps11, _ = split_output(cli("demo", "--json", "--mech", "m11").json_lines())
    assert all(list(step)[-1] == "tokens" for step in steps11)
    assert steps[0]["tokens"] == {"r0": [steps[0]["tokens"]["r0"][0]]}


def test_json_explain_is_last_and_only_with_explain(cli) -> None:
    plain, _ = split_output(cli("demo", "--json").json_lines())
    explained, summary = split_output(cli("demo", "--json", "--explain").json_lines())
    assert all("explain" not in step for step in plain)
    assert all(list(step)[-1] == "explain" for step in explained)
    assert any("admitted" in sentence for sentence in explained[0]["explain"])
    assert [{k: v for k, v in step.items() if k != "explain"} for step in explained] == plain
    assert summary is not None


def test_empty_requests_print_only_the_summary(cli, spec_file) -> None:
    for workload in ({}, {"requests": []}, {"engine": None, "requests": None}):
        result = cli("run", "--spec", spec_file(workload), "--json")
        assert result.code == 0
        assert result.lines == ['{"summary": []}']


def test_request_flags_match_the_equivalent_spec(cli, spec_file) -> None:
    workload = {
        "requests": [
            {"request_id": "a", "prompt_len": 5, "max_new_tokens": 3},
            {"request_id": "b", "prompt_len": 9, "max_new_tokens": 2, "arrival_step": 1, "eos_after": 1},
        ]
    }
    from_spec = cli("run", "--spec", spec_file(workload), "--json")
    from_flags = cli("run", "--request", "a:5:3", "--request", "b:9:2:1:1", "--json")
    assert from_flags.code == from_spec.code == 0
    assert from_flags.out == from_spec.out


def test_engine_flags_override_the_spec(cli) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    path_text = json.dumps(example["workload"])
    result = cli("run", "--spec", "-", "--num-pages", "8", "--json", stdin=path_text)
    assert result.code == 0, result.err
    assert result.json_lines()[-1]["summary"][0]["state"] == "FINISHED"


def run_on(cli, mech: str, *argv: str, stdin: str | None = None):
    result = cli(*argv, "--json", "--mech", mech, stdin=stdin)
    assert result.code == 0, result.err
    return split_output(result.json_lines())


@pytest.mark.parametrize("path", SAME_ON_M12, ids=[p.stem for p in SAME_ON_M12])
def test_m12_gives_the_examples_contract_fields(path: Path, cli) -> None:
    """With every request through the door and no admission settings, m12 is m11 plus empty door fields (N21)."""
    text = json.dumps(load_example(path)["workload"])
    steps11, summary11 = run_on(cli, "m11", "run", "--spec", "-", stdin=text)
    steps12, summary12 = run_on(cli, "m12", "run", "--spec", "-", stdin=text)
    assert [contract_part(step) for step in steps12] == [contract_part(step) for step in steps11]
    assert [step["tokens"] for step in steps12] == [step["tokens"] for step in steps11]
    assert all(step["rejected"] == [] and step["aborted"] == [] for step in steps12)
    assert summary12 == summary11 == load_example(path)["summary"]


def test_m12_gives_the_demos_contract_fields(cli) -> None:
    steps11, summary11 = run_on(cli, "m11", "demo")
    steps12, summary12 = run_on(cli, "m12", "demo")
    assert [contract_part(step) for step in steps12] == [contract_part(step) for step in steps11]
    assert summary12 == summary11 == load_example(DATA / "demo.json")["summary"]
    assert cli("demo", "--json").out == cli("demo", "--json", "--mech", "m12").out  # m12 is the default


def test_example_07_on_m12_rejects_big_at_the_door(cli) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    steps, summary = run_on(cli, "m12", "run", "--spec", "-", stdin=json.dumps(example["workload"]))
    assert steps[0]["rejected"] == [["big", "NEVER_FITS"]]
    assert steps[0]["admitted"] == ["small"]
    assert all("big" not in json.dumps({k: v for k, v in step.items() if k != "rejected"}) for step in steps)
    assert all(step["rejected"] == [] for step in steps[1:])
    assert summary == [
        {"request_id": "big", "state": "REJECTED", "generated": 0, "computed": 0, "finish_reason": None},
        {"request_id": "small", "state": "FINISHED", "generated": 2, "computed": 4, "finish_reason": "LENGTH"},
    ]
