"""``mechserve run``/``demo`` on m15: the fleet section, its flags, its errors and its output."""

from __future__ import annotations

from typing import Any

import pytest
from cli_support import assert_one_error_line

WORKLOAD: dict[str, Any] = {
    "engine": {"max_step_tokens": 16, "page_size": 4, "num_pages": 16},
    "fleet": {"replicas": 2, "routing_policy": "cache_aware"},
    "requests": [
        {"request_id": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_new_tokens": 3},
        {"request_id": "b", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 20], "max_new_tokens": 2, "arrival_step": 2},
        {"request_id": "c", "tokens": [30, 31, 32, 33, 34], "max_new_tokens": 2, "arrival_step": 2},
    ],
}


def with_fleet(**fleet: Any) -> dict[str, Any]:
    return {**WORKLOAD, "fleet": fleet}


@pytest.mark.parametrize(
    ("fleet", "needles"),
    [
        ({"replicas": 0}, ["fleet.replicas", "integer > 0"]),
        ({"replicas": 257}, ["fleet.replicas", "at most 256"]),
        ({"replicas": 1.5}, ["fleet.replicas"]),
        ({"routing_policy": "random"}, ["fleet.routing_policy", "round_robin", "precise", '"random"']),
        ({"cache_threshold": 1.2}, ["fleet.cache_threshold", "from 0 to 1"]),
        ({"cache_threshold": True}, ["fleet.cache_threshold"]),
        ({"balance_abs_threshold": -1}, ["fleet.balance_abs_threshold"]),
        ({"balance_rel_threshold": "2"}, ["fleet.balance_rel_threshold"]),
        ({"policy": "precise"}, ["fleet", 'unknown key "policy"', "routing_policy"]),
    ],
)
def test_bad_fleet_values_are_one_error_line(cli, spec_file, fleet: dict[str, Any], needles: list[str]) -> None:
    assert_one_error_line(cli("run", "--mech", "m15", "--spec", spec_file(with_fleet(**fleet))), *needles)


def test_fleet_section_must_be_an_object_and_null_means_none(cli, spec_file) -> None:
    assert_one_error_line(
        cli("run", "--mech", "m15", "--spec", spec_file({**WORKLOAD, "fleet": [2]})), "fleet", "JSON object"
    )
    result = cli("run", "--mech", "m15", "--spec", spec_file({**WORKLOAD, "fleet": None}), "--json")
    assert result.code == 0 and all(len(line.get("replicas", [0])) == 1 for line in result.json_lines()[:-1])


def test_flags_override_the_section_and_bad_flags_are_refused(cli, spec_file) -> None:
    result = cli(
        "run",
        "--mech",
        "m15",
        "--spec",
        spec_file(WORKLOAD),
        "--replicas",
        "3",
        "--routing-policy",
        "round_robin",
        "--json",
    )
    lines = result.json_lines()
    assert result.code == 0 and len(lines[0]["replicas"]) == 3
    assert [d["replica"] for line in lines[:-1] for d in line["routed"]] == [0, 1, 2]
    assert_one_error_line(
        cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--replicas", "0"), "--replicas", "> 0"
    )
    assert_one_error_line(
        cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--cache-threshold", "2"),
        "--cache-threshold",
        "0 to 1",
    )
    assert cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--routing-policy", "fastest").code == 2


def test_below_m15_the_section_is_refused_and_the_demo_drops_it(cli, spec_file) -> None:
    line = assert_one_error_line(cli("run", "--mech", "m12", "--spec", spec_file(WORKLOAD)), "m12 has no routing")
    assert "fleet.replicas 2" in line and 'fleet.routing_policy "cache_aware"' in line
    assert_one_error_line(cli("run", "--mech", "m14", "--spec", spec_file(WORKLOAD)), "m14 has no routing")
    # the default rung, m16, carries m15's routing: the section runs a fleet there
    result = cli("run", "--spec", spec_file(WORKLOAD), "--json")
    assert result.code == 0 and list(result.json_lines()[0]) == ["step", "routed", "replicas"]


def test_fleet_text_view_and_explain(cli, spec_file) -> None:
    result = cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--explain")
    assert result.code == 0
    out = result.out
    assert "replicas 2 · routing_policy cache_aware" in out.splitlines()[0]
    assert "routed  a -> 0 (smallest_tree)" in out and "b -> 0 (cache_hit), c -> 1 (smallest_tree)" in out
    assert "the router sent it 8 of the prompt's 9 tokens before" in out
    assert "  replica 1" in out
    table = out.splitlines()[-4:]
    assert table[0].split() == ["request", "replica", "state", "finish", "generated", "computed"]
    assert [row.split()[:2] for row in table[1:]] == [["a", "0"], ["b", "0"], ["c", "1"]]


def test_fleet_json_carries_decisions_records_and_events(cli, spec_file) -> None:
    lines = cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--json").json_lines()
    first = lines[0]
    assert list(first) == ["step", "routed", "replicas"]
    assert set(first["routed"][0]) == {"request_id", "replica", "policy", "rule", "matched", "reason"}
    assert first["replicas"][0]["kv_events"][0]["type"] == "BlockStored"
    assert lines[-1]["summary"][1] == {
        "request_id": "b",
        "state": "FINISHED",
        "generated": 2,
        "computed": 10,
        "finish_reason": "LENGTH",
        "replica": 0,
    }


def test_pictures_and_the_torch_backend_refuse_a_fleet(cli, spec_file, tmp_path) -> None:
    assert_one_error_line(
        cli("run", "--mech", "m15", "--spec", spec_file(WORKLOAD), "--viz", str(tmp_path / "t.json")), "--viz", "fleet"
    )
    assert_one_error_line(cli("demo", "--mech", "m15", "--plot", str(tmp_path / "t.png")), "fleet")
    assert_one_error_line(
        cli("run", "--spec", spec_file(WORKLOAD), "--mech", "m15", "--backend", "torch"), "top engine rung (m16)"
    )
    no_fleet = {**WORKLOAD, "fleet": None}
    assert_one_error_line(
        cli("run", "--spec", spec_file(no_fleet), "--replicas", "2", "--backend", "torch"),
        "--replicas 2",
        "--backend spec",
    )


def test_demo_on_m15_is_a_fleet(cli) -> None:
    result = cli("demo", "--mech", "m15", "--explain")
    assert result.code == 0
    assert "m15 Routing" in result.out and "replicas 2 · routing_policy precise" in result.out
    assert "t1 -> 0 (longest_prefix)" in result.out
    assert "no replica holds its first block" in result.out
