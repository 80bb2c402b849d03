"""``mechserve bench fleet``: the workloads, the figures, the cost model's calibration, the targets and bad flags.

Counts are deterministic for a seed; wall time is never asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechserve.bench import fleet, fleet_workloads
from mechserve.bench.fleet_sim import CostModel, simulate
from mechserve.cli.main import main
from mechserve.spec import m15_routing as m15

SMALL = fleet_workloads.Sizes(
    requests=120,
    rate=4.0,
    tenants=6,
    system=(24, 40),
    message=(4, 12),
    output=(2, 6),
    documents=20,
    document=(16, 32),
    uniform=(8, 40),
)
ENGINE = {"max_step_tokens": 64, "page_size": 4, "num_pages": 96, "max_running": 8, "output_caching": True}
COST = CostModel(0.036, 0.0014, "test")


@pytest.mark.parametrize("name", fleet_workloads.WORKLOADS)
def test_workloads_are_seeded_and_shaped(name: str) -> None:
    def arrivals(seed: int) -> list[tuple[int, str, int]]:
        w = fleet_workloads.make(name, SMALL, seed)
        out, step = [], 0
        while not w.exhausted and step < 10_000:
            for a in w.due(step):
                out.append((a.step, a.request_id, hash(tuple(a.tokens))))
                assert all(t > 0 for t in a.tokens), "token 0 is the scripted model's EOS id"
                w.finished(a.request_id, step + 3, [7, 8, 9])
            step += 1
        return out

    first = arrivals(1)
    assert first == arrivals(1) and first != arrivals(2)
    assert len(first) == SMALL.requests and len({rid for _, rid, _ in first}) == SMALL.requests


def test_a_later_turn_carries_the_conversation_as_its_prefix() -> None:
    w = fleet_workloads.make("multiturn", SMALL, 0)
    (first, *_) = w.due(w._heap[0][0])
    w.finished(first.request_id, 10, [5, 6, 7])
    later = [
        a
        for step in range(11, 200)
        for a in w.due(step)
        if a.request_id.split(".")[0] == first.request_id.split(".")[0]
    ]
    assert later and later[0].tokens[: len(first.tokens) + 3] == [*first.tokens, 5, 6, 7]
    assert later[0].step >= 11 + SMALL.think[0]


def test_simulation_figures_and_the_ideal_bound() -> None:
    results = {}
    for policy in m15.POLICIES:
        r = simulate(fleet_workloads.make("tenants", SMALL, 0), replicas=3, policy=policy, engine=ENGINE, cost=COST)
        results[policy] = r.as_json()
    rr, ca = results["round_robin"], results["cache_aware"]
    assert all(r["requests"] == SMALL.requests for r in results.values())
    assert rr["prompt_tokens"] == ca["prompt_tokens"] and rr["rules"] == {"rotation": SMALL.requests}
    assert ca["prefill_tokens_computed"] < rr["prefill_tokens_computed"]
    for r in results.values():
        assert r["ideal_prefill_tokens"] <= r["prefill_tokens_computed"] <= r["computed_tokens"]
        assert 0 <= r["prefix_hit_rate"] <= 1 and r["imbalance"] >= 1 and r["ttft_p50_s"] > 0
        assert sum(r["rules"].values()) == SMALL.requests
    again = simulate(fleet_workloads.make("tenants", SMALL, 0), replicas=3, policy="precise", engine=ENGINE, cost=COST)
    assert {k: v for k, v in again.as_json().items() if k != "wall_seconds"} == {
        k: v for k, v in results["precise"].items() if k != "wall_seconds"
    }


def test_calibrate_fits_a_and_b(tmp_path: Path) -> None:
    tokens = [512, 64, 1, 1, 256, 32]
    doc = {
        "workloads": {
            "throughput": {
                "runs": [
                    {
                        "engine": "mechserve",
                        "engine_stats": {
                            "tokens_per_step_series": tokens,
                            "step_time_series_s": [0.05 + 0.002 * t for t in tokens],
                        },
                    },
                    {"engine": "hf", "engine_stats": {"tokens_per_step_series": [1], "step_time_series_s": [9.0]}},
                ]
            }
        }
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    a, b, source = fleet.calibrate(path)
    assert a == pytest.approx(0.05) and b == pytest.approx(0.002) and "6 steps" in source
    path.write_text(json.dumps({"workloads": {}}))
    with pytest.raises(ValueError, match="no mechserve run"):
        fleet.calibrate(path)


def test_targets_report_met_missed_and_not_measured() -> None:
    runs = [
        {"workload": "tenants", "replicas": 16, "policy": p, "prefill_tokens_computed": v, "imbalance": i}
        for p, v, i in (
            ("round_robin", 100, 1.1),
            ("least_loaded", 100, 1.0),
            ("cache_aware", 40, 1.6),
            ("precise", 38, 1.2),
            ("oracle", 37, 2.0),
        )
    ]
    verdicts = {t["target"]: t["verdict"] for t in fleet.check_targets(runs)}
    assert verdicts["cache_aware prefill <= 0.5 x round_robin's"] == "met"
    assert verdicts["precise prefill within 5% of oracle's"] == "met"
    assert verdicts["cache_aware imbalance <= 1.5"] == "missed"
    partial = fleet.check_targets([r for r in runs if r["policy"] != "oracle"])
    assert {t["verdict"] for t in partial if "oracle" in t["target"]} == {"not measured"}


def test_bench_fleet_end_to_end_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet"
    argv = [
        "bench",
        "fleet",
        "--replicas",
        "2",
        "--requests",
        "60",
        "--workloads",
        "uniform,rag",
        "--policies",
        "round_robin,precise",
    ]
    assert main([*argv, "--max-step-tokens", "4096", "--num-pages", "4096", "--out", str(out), "--no-plots"]) == 0
    doc = json.loads((out / "fleet.json").read_text())
    assert [(r["workload"], r["policy"]) for r in doc["runs"]] == [
        ("uniform", "round_robin"),
        ("uniform", "precise"),
        ("rag", "round_robin"),
        ("rag", "precise"),
    ]
    assert doc["cost_model"]["source"].startswith("docs/benchmarks.md") and doc["targets"] == []
    assert "uniform, 2 replicas, 60 requests" in capsys.readouterr().out
    assert doc["router"]["load_guard"] is True
    assert (
        main(
            [
                *argv,
                "--max-step-tokens",
                "4096",
                "--num-pages",
                "4096",
                "--out",
                str(out),
                "--no-plots",
                "--no-load-guard",
            ]
        )
        == 0
    )
    assert json.loads((out / "fleet.json").read_text())["router"]["load_guard"] is False


def test_load_guard_is_what_spreads_a_hot_prefix() -> None:
    """With a zero absolute threshold the guard fires on tenants; without it precise never leaves a holder."""
    options = {"balance_abs_threshold": 0, "balance_rel_threshold": 1.0}
    on, off = (
        simulate(
            fleet_workloads.make("tenants", SMALL, 0),
            replicas=3,
            policy="precise",
            engine=ENGINE,
            cost=COST,
            fleet_options={**options, "load_guard": guard},
        ).as_json()
        for guard in (True, False)
    )
    assert on["rules"].get("load:imbalanced", 0) > 0 and "load:imbalanced" not in off["rules"]
    assert on["imbalance"] <= off["imbalance"]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--policies", "fastest"], "unknown policy"),
        (["--workloads", "chat"], "unknown workload"),
        (["--cache-threshold", "2"], "--cache-threshold"),
        (["--calibrate", "/nonexistent/results.json"], "cannot read"),
    ],
)
def test_bad_flags_are_one_error_line(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fleet", "--requests", "10", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
