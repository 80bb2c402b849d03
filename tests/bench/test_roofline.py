"""The roofline's arithmetic (``bench/roofline.py``) and the line each ``bench run`` gives a mechserve run
(``run._run_roofline``): bytes and FLOPs of a decode step counted by hand on a tiny model, the floor
``max(bytes / bandwidth, FLOPs / peak)``, the ratio to the measured step, and which of a run's steps are
its decode steps at the typical batch.  Speed is never asserted: a measured time is only checked to be
positive and to divide as the report says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny, tiny_config

from mechserve.bench import roofline as rf
from mechserve.bench import runners
from mechserve.bench.run import SHARED_CORES, _run_roofline, shared_machine_warning
from mechserve.model.loader import load_model
from mechserve.model.quantized import QuantizedMatrix


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("roofline-tiny")
    save_tiny(path, tiny_config())
    return path


@pytest.fixture(scope="module", params=["exact", "fast", "q8_0"])
def model(request: pytest.FixtureRequest, tiny_path: Path):
    dtype, quantization = {
        "exact": (torch.float32, None),
        "fast": (torch.bfloat16, None),
        "q8_0": (torch.bfloat16, "q8_0"),
    }[request.param]
    return load_model(str(tiny_path), dtype=dtype, tokenizer=False, quantization=quantization).model


def _matrix_bytes(m) -> int:
    return m.blocks.numel() if isinstance(m, QuantizedMatrix) else m.numel() * m.element_size()


def test_decode_cost_counts_every_weight_and_kv_position_once(model) -> None:
    a = model.arch  # 2 layers, hidden 64, MLP 128, 4 heads of 16 over 2 KV heads, vocabulary 128
    batch, context = 3, 10
    kv_size = model.new_cache(2, 16).k.element_size()
    weights = sum(_matrix_bytes(m) for w in model.layers for m in (w.qkv, w.o, w.gate_up, w.down))
    weights += _matrix_bytes(model.lm_head)
    # K and V, every layer, every request's positions 0..context (the step's own included)
    kv = 2 * a.num_layers * batch * (context + 1) * a.num_kv_heads * a.head_dim * kv_size
    params = a.num_layers * (
        (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * a.hidden_size  # qkv
        + a.hidden_size * a.num_heads * a.head_dim  # o
        + 3 * a.hidden_size * a.intermediate_size  # gate, up, down
    )
    # a multiply-add is 2 FLOPs: matrices and head per row, q.k and p.v per (query head, position)
    flops = 2 * params * batch + 2 * a.hidden_size * a.vocab_size * batch
    flops += 2 * 2 * a.num_heads * a.head_dim * a.num_layers * batch * (context + 1)
    cost = rf.decode_cost(model, batch, context, kv_size)
    assert cost == {"bytes": weights + kv, "flops": flops}
    if model.quantization == "q8_0":  # 34 bytes per 32 weights
        assert weights == (params + a.hidden_size * a.vocab_size) // 32 * 34


def test_the_floor_is_the_larger_of_reading_and_computing() -> None:
    memory = rf.step_floor({"bytes": 2_000_000_000, "flops": 10**9}, 20e9, 100.0)
    assert memory["memory_s"] == pytest.approx(0.1) and memory["compute_s"] == pytest.approx(0.01)
    assert memory["roofline_s"] == memory["memory_s"] and memory["bound"] == "memory"
    compute = rf.step_floor({"bytes": 10**6, "flops": 10**12}, 20e9, 100.0)
    assert compute["roofline_s"] == pytest.approx(10.0) and compute["bound"] == "compute"
    assert compute["bandwidth_gb_per_s"] == 20.0 and compute["peak_gflops"] == 100.0
    for bandwidth, peak in ((0.0, 100.0), (20e9, 0.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="positive bandwidth and peak"):
            rf.step_floor({"bytes": 1, "flops": 1}, bandwidth, peak)


def test_decode_roofline_sets_the_measured_step_beside_its_floor(model) -> None:
    r = rf.decode_roofline(model, 4, 20, bandwidth=10e9, peak_gflops=50.0, repeats=1)
    kv_size = model.new_cache(2, 16).k.element_size()
    assert (r["batch"], r["context"]) == (4, 20)
    assert {"bytes": r["bytes"], "flops": r["flops"]} == rf.decode_cost(model, 4, 20, kv_size)
    assert r["memory_s"] == pytest.approx(r["bytes"] / 10e9)
    assert r["compute_s"] == pytest.approx(r["flops"] / 50e9)
    assert r["roofline_s"] == max(r["memory_s"], r["compute_s"])
    assert r["measured_s"] > 0
    assert r["measured_over_roofline"] == pytest.approx(r["measured_s"] / r["roofline_s"])
    line = rf.roofline_line(r)
    assert line.startswith("decode step at batch 4, context 20: ")
    assert f"roofline {r['roofline_s'] * 1e3:.1f} ms ({r['bound']}-bound)" in line
    assert line.endswith(f"= {r['measured_over_roofline']:.2f}x")


def _stats(rows: list[int], tokens: list[int], seconds: list[float], context: float | None = 12.0) -> dict:
    return {
        "decode_rows_series": rows,
        "tokens_per_step_series": tokens,
        "step_time_series_s": seconds,
        "decode_context_mean": context,
    }


def test_a_runs_line_is_at_its_typical_batch_beside_its_own_decode_steps(monkeypatch, model) -> None:
    """The typical batch is the median of the steps' decode rows (steps without any left out); the run's
    own steps at that batch are those that ran exactly one token for each of them and nothing else."""
    asked: list[tuple[int, int]] = []

    def probe(m, batch, context, bandwidth, peak, repeats=3):
        asked.append((batch, context))
        return {"batch": batch, "context": context, "roofline_s": 0.002, "measured_s": 0.003}

    monkeypatch.setattr(rf, "decode_roofline", probe)
    # a prefill-only step, two mixed steps (3 decode rows beside prefill tokens), four pure steps at 3, one
    # at 2 and one speculative step (3 rows, 7 tokens)
    rows = [0, 3, 3, 3, 3, 3, 3, 2, 3]
    tokens = [40, 35, 3, 3, 3, 3, 20, 2, 7]
    seconds = [0.5, 0.4, 0.010, 0.008, 0.012, 0.009, 0.2, 0.005, 0.02]
    r = _run_roofline(model, _stats(rows, tokens, seconds, 12.4), 10e9, 50.0)
    assert asked == [(3, 12)]
    assert r["run_steps"] == 4 and r["run_step_s"] == pytest.approx(0.0095)  # median of 10, 8, 12, 9 ms
    assert r["run_over_roofline"] == pytest.approx(0.0095 / 0.002)
    assert r["run_forward_s"] is None and r["other_cores"] is None  # a run that recorded neither
    # the forward of the same pure steps, where the run recorded one per step, and the machine's other load
    forwards = [0.4, 0.3, 0.007, 0.006, 0.011, 0.008, 0.15, 0.004, 0.018]
    stats = {**_stats(rows, tokens, seconds, 12.4), "forward_time_series_s": forwards, "other_cores": 0.7}
    r = _run_roofline(model, stats, 10e9, 50.0)
    assert r["run_forward_s"] == pytest.approx(0.0075)  # median of 7, 6, 11, 8 ms
    assert r["run_step_s"] == pytest.approx(0.0095) and r["other_cores"] == 0.7
    # no pure decode step at the typical batch: the line says so rather than inventing one
    r = _run_roofline(model, _stats([2, 2, 2], [9, 9, 9], [0.1, 0.1, 0.1]), 10e9, 50.0)
    assert r["run_steps"] == 0 and r["run_step_s"] is None and r["run_over_roofline"] is None
    # a run that decoded nothing has no line
    assert _run_roofline(model, _stats([0, 0], [16, 16], [0.1, 0.1], None), 10e9, 50.0) is None
    assert _run_roofline(model, None, 10e9, 50.0) is None


def test_the_line_names_the_runs_steps() -> None:
    r = {
        "batch": 32,
        "context": 300,
        "bytes": 300e6,
        "flops": 8e9,
        "bandwidth_gb_per_s": 20.0,
        "peak_gflops": 400.0,
        "memory_s": 0.015,
        "compute_s": 0.02,
        "roofline_s": 0.02,
        "bound": "compute",
        "measured_s": 0.03,
        "measured_over_roofline": 1.5,
    }
    assert rf.roofline_line(r) == (
        "decode step at batch 32, context 300: 300 MB / 20.0 GB/s = 15.0 ms, 8.00 GFLOP / 400 GFLOP/s = 20.0 ms; "
        "roofline 20.0 ms (compute-bound), measured 30.0 ms = 1.50x"
    )
    with_run = {**r, "run_steps": 12, "run_step_s": 0.04, "run_over_roofline": 2.0}
    assert rf.roofline_line(with_run).endswith("; the run's 12 decode steps at batch 32: median 40.0 ms = 2.00x")
    assert rf.roofline_line({**r, "run_steps": 0}).endswith("; the run had no pure decode step at batch 32")
    split = {**with_run, "run_forward_s": 0.031, "other_cores": 0.64}
    assert rf.roofline_line(split).endswith(
        "; the run's 12 decode steps at batch 32: median 40.0 ms = 2.00x (forward 31.0 ms); "
        "other processes used 0.64 cores during the run"
    )


def test_other_load_is_the_machines_busy_time_less_this_processs_per_second() -> None:
    """``/proc/stat``'s first line in ticks: busy is user + nice + system + irq + softirq (idle and iowait are
    not), steal apart; what other processes used is the machine's busy time less this process's CPU."""
    text = "cpu  1000 50 250 9000 40 5 15 30 0 0\ncpu0 500 25 125 4500 20 2 7 15 0 0\n"
    assert runners.parse_proc_stat(text, 100) == (13.2, 0.3)
    with pytest.raises(ValueError, match="cpu line"):
        runners.parse_proc_stat("intr 1 2 3\n", 100)
    # 2 s of wall: the machine was busy 3 CPU seconds, 1.2 of them this process's; the host stole 0.5 s
    load = runners.other_load((10.0, 1.0), (13.0, 1.5), 1.2, 2.0)
    assert load["other_cores"] == pytest.approx(0.9) and load["steal_cores"] == pytest.approx(0.25)
    # clock ticks are coarser than a process's CPU time: never a negative load
    assert runners.other_load((10.0, 1.0), (10.0, 1.0), 0.01, 1.0)["other_cores"] == 0.0
    assert runners.other_load(None, (1.0, 0.0), 0.0, 1.0) == {"other_cores": None, "steal_cores": None}
    reading = runners.machine_cpu()
    assert reading is None or (reading[0] > 0 and reading[1] >= 0)


def test_a_run_on_a_shared_machine_says_so() -> None:
    """Above ``SHARED_CORES`` of other processes' CPU a run gets a warning naming the load; at or below it, or
    without the figure (another engine, an older record), none."""
    said = shared_machine_warning({"other_cores": 0.61}, 2)
    assert said is not None and "other processes used 0.61 cores during this run" in said and "2 thread(s)" in said
    assert shared_machine_warning({"other_cores": SHARED_CORES}, 2) is None
    assert shared_machine_warning({"other_cores": 0.0}, 1) is None
    assert shared_machine_warning({"other_cores": None}, 2) is None
    assert shared_machine_warning({}, 2) is None and shared_machine_warning(None, 2) is None
