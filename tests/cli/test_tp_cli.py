"""``--world-size`` on ``mechserve run --backend torch`` and ``generate``, and the same command under ``torchrun``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_torch import PROMPT, PROMPT_IDS, call, final_json
from tiny_engines import hf_greedy

REPO = Path(__file__).resolve().parents[2]


def test_run_torch_world_size_2_gives_world_size_1s_trace_and_texts(tiny_dir, capsys) -> None:
    """m11 N9 on real ranks: the step records (tokens included) do not depend on the world size."""
    path, _ = tiny_dir
    argv = ["run", "--backend", "torch", "--model", str(path), "--json", "--request", "a:10:4", "--request", "b:5:3:1"]
    argv += ["--page-size", "4", "--max-step-tokens", "8"]
    rc, one, err = call(argv, capsys)
    assert rc == 0, err
    rc, two, err = call([*argv, "--world-size", "2"], capsys)
    assert rc == 0, err
    assert two.splitlines() == one.splitlines()
    assert [len(o["token_ids"]) for o in final_json(two)["outputs"]] == [4, 3]


@pytest.mark.slow
def test_generate_world_size_2_is_transformers_greedy(tiny_dir, capsys) -> None:
    path, hf = tiny_dir
    argv = ["generate", PROMPT, "--model", str(path), "--max-tokens", "6", "--json", "-q", "--world-size", "2"]
    rc, out, err = call(argv, capsys)
    assert rc == 0, err
    assert final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, PROMPT_IDS, 6)


@pytest.mark.slow
def test_generate_under_torchrun_is_transformers_greedy(tiny_dir) -> None:
    """Every process runs the same command; rank 0 prints, the other rank serves and exits 0."""
    path, hf = tiny_dir
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "mechserve.cli.main", "generate", PROMPT, "--model", str(path), "--max-tokens", "6"]
    command += ["--json", "-q", "--world-size", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"summary"')]
    assert len(results) == 1  # rank 0 alone reports
    assert results[0]["outputs"][0]["token_ids"] == hf_greedy(hf, PROMPT_IDS, 6)
