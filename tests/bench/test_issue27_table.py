"""``docs/scripts/issue27_table.py``: the bench command it starts (accepted by the bench's own parser), the table
and the issue's targets met or missed from a report."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from mechserve.bench import spec_decode

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "scripts" / "issue27_table.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("issue27_table", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


table = _load()


def test_the_command_is_the_bench_in_fast_mode_at_batch_1_and_8_with_llama_cpp() -> None:
    parser = argparse.ArgumentParser()
    spec_decode.add_arguments(parser)
    for quick in (False, True):
        cmd = table.bench_command(quick, ["--spec-len", "6"])
        assert cmd[1:5] == ["-m", "mechserve", "bench", "spec-decode"]
        args = parser.parse_args(cmd[5:])  # every flag is one the bench takes
        assert args.mode == "fast" and args.batches == [1, 8] and args.llama_cpp and args.json
        assert args.sets == list(table.WORKLOADS) and args.configs[:4] == ["off", "ngram", "suffix", "draft"]
        assert (args.prompts, args.max_tokens) == ((2, 32) if quick else (8, 128)) and args.spec_len == 6


def _r(tok_s: float, speedup: float | None, kept: float = 1.0, by_position: tuple[float, ...] = ()) -> dict[str, Any]:
    return {
        "tok_s": tok_s,
        "speedup": speedup,
        "tokens_per_decode_step": kept,
        "acceptance_by_position": list(by_position),
    }


def report() -> dict[str, Any]:
    cells: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    # batch 1: chat 2.0x (met), agent 1.5x (missed), code-edit 1.9x, summarise 1.3x, novel 0.95x (missed)
    for workload, best in (("chat", 2.0), ("agent", 1.5), ("code-edit", 1.9), ("summarise", 1.3), ("novel", 0.95)):
        cells[f"{workload}/batch-1"] = {
            "off": _r(100.0, None),
            "ngram": _r(90.0, 0.9, 1.2, (0.5, 0.2)),
            "suffix": _r(100.0 * best, best, 2.5, (0.8, 0.6)),
        }
        # llama.cpp's best: 120 tok/s, so chat's suffix is 1.67x (met), agent's 1.25x (missed)
        side = {
            "bf16": {"tok_s": 110.0, "identical": 3, "requests": 4},
            "q8_0": {"tok_s": 120.0, "identical": 0, "requests": 4},
        }
        peers[f"{workload}/batch-1"] = {
            **side,
            "best": {
                "llama_cpp": "q8_0",
                "llama_cpp_tok_s": 120.0,
                "config": "suffix",
                "config_tok_s": 100.0 * best,
                "ratio": round(best / 1.2, 3),
                "off_ratio": round(1 / 1.2, 3),
            },
        }
        # batch 8: only novel's ngram is slower than off
        slow = 0.9 if workload == "novel" else 1.05
        cells[f"{workload}/batch-8"] = {
            "off": _r(300.0, None),
            "ngram": _r(300.0 * slow, slow),
            "suffix": _r(330.0, 1.1),
        }
    return {
        "model": "smollm2",
        "mode": "fast",
        "threads": 2,
        "max_tokens": 128,
        "prompts_per_set": 8,
        "cells": cells,
        "llama_cpp": {"ggufs": {"bf16": "a-bf16.gguf", "q8_0": "a-q8_0.gguf"}, "version": "v", "cells": peers},
    }


def test_the_targets_say_met_or_missed_and_a_miss_carries_its_acceptance_profile() -> None:
    lines = table.targets(report())
    text = "\n".join(lines)
    assert "- [met] batch 1 chat: best suffix 2.00x off (>= 1.8x)" in text
    missed = next(line for line in lines if line.startswith("- [MISSED] batch 1 agent: best suffix 1.50x off"))
    assert "acceptance by position 0.80 / 0.60" in missed and "kept/step 2.5" in missed
    assert "- [met] batch 1 summarise" in text and "- [MISSED] batch 1 novel: best suffix 0.95x" in text
    assert "- [met] batch 1 chat: suffix 200.0 tok/s = 1.67x llama.cpp q8_0 120.0 (>= 1.5x)" in text
    assert "- [MISSED] batch 1 agent: suffix 150.0 tok/s = 1.25x llama.cpp" in text
    assert "- [not measured] batch 1 novel: eagle" in text  # no eagle configuration in this run
    assert "- [MISSED] batch 8 novel: slowest adaptive ngram (ngram 0.90x, suffix 1.10x; >= 1.0x)" in text
    assert "- [met] batch 8 chat: slowest adaptive ngram (ngram 1.05x, suffix 1.10x; >= 1.0x)" in text
    assert len(lines) == 5 + 3 + 1 + 5


def test_the_table_has_every_cell_and_llama_cpp_beside() -> None:
    text = table.render(report())
    assert "| chat | suffix | 200.0 | 2.00 | 1.67 | 2.50 | 0.80 / 0.60 |" in text
    assert "| chat | off | 100.0 | 1.00 | 0.83 | 1.00 | - |" in text
    assert "| chat | llama.cpp q8_0 (best) | 120.0 | | 1.00 | | same ids: 0/4 |" in text
    assert "| chat | llama.cpp bf16 | 110.0 | | 0.92 | | same ids: 3/4 |" in text
    assert "**Batch 8**" in text and "| novel | ngram | 270.0 | 0.90 | - |" in text  # no llama.cpp at batch 8 here
