"""The benchmarks with a GGUF file (issue 30), without llama.cpp: bench run in fresh processes, perplexity with
a BOS-adding vocabulary as llama-perplexity scores it, the tokenizer comparison, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gguf_models import bpe_vocab, spm_vocab, tiny_hf, write_gguf

from mechserve.bench import llama_cpp, perplexity
from mechserve.bench.runners import LlamaCppRunner
from mechserve.cli.main import main

TEXT = Path(__file__).parents[2] / "mechserve" / "bench" / "data" / "declaration-of-independence.txt"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf")
    vocab = bpe_vocab(tmp)
    path = tmp / "tiny.Q4_K_M.gguf"
    write_gguf(path, tiny_hf("llama", vocab_size=len(vocab.tokens)), "llama", "q4_k", vocab)
    return path


def test_bench_run_takes_a_gguf_file_and_measures_each_run_alone(tmp_path, gguf_file, capsys) -> None:
    out = tmp_path / "out"
    argv = ["bench", "run", "--model", str(gguf_file), "--quick", "--workload", "latency", "--mode", "exact,fast"]
    assert main([*argv, "--engine", "mechserve,hf", "--no-roofline", "--no-plots", "--out", str(out)]) == 0
    assert "hf skipped: a GGUF file runs in mechserve and llama.cpp here" in capsys.readouterr().err
    runs = json.loads((out / "results.json").read_text())["workloads"]["latency"]["runs"]
    assert [(r["engine"], r["mode"]) for r in runs] == [("mechserve", "exact"), ("mechserve", "fast")]
    for r in runs:  # each in a process that loaded only its own mode
        assert 0 < r["peak_rss_bytes"] <= r["process_peak_rss_bytes"]
        assert r["metrics"]["completed"] == len(r["outputs"])


def test_bench_run_refuses_a_block_mode_for_a_gguf_file(tmp_path, gguf_file, capsys) -> None:
    argv = ["bench", "run", "--model", str(gguf_file), "--quick", "--mode", "q4_1", "--out", str(tmp_path)]
    assert main([*argv, "--no-roofline", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mode q4_1: a GGUF file runs its weights as it stores them" in err


def test_llama_cpp_runs_a_gguf_file_itself(gguf_file, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))
    said = LlamaCppRunner("fast", model=str(gguf_file)).available()
    assert said is not None and "llama-server not found" in said  # not "the embedded model only"
    with pytest.raises(ValueError, match="no GGUF kind 'q3_k'"):
        llama_cpp.ensure_gguf("q3_k")


def test_perplexity_with_a_bos_adding_vocabulary_scores_as_llama_perplexity(tmp_path) -> None:
    """A SentencePiece file adds a BOS: llama-perplexity then puts BOS first in every chunk."""
    from mechserve.model.loader import load_model

    vocab = spm_vocab(tmp_path, TEXT.read_text())
    path = tmp_path / "spm.gguf"
    write_gguf(path, tiny_hf("llama", vocab_size=len(vocab.tokens), max_position_embeddings=64), "llama", "q8_0", vocab)
    out = tmp_path / "out"
    argv = ["bench", "perplexity", "--model", str(path), "--engine", "mechserve", "--mode", "fast", "--ctx", "32"]
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads((out / "perplexity.json").read_text())
    (run,) = doc["runs"]
    loaded = load_model(str(path), dtype=torch.bfloat16)
    ids = loaded.tokenizer(TEXT.read_text()).input_ids
    assert ids[0] == 1 and doc["tokens"] == len(ids)
    with torch.inference_mode():
        want = perplexity.mechserve_perplexity(loaded.model, ids, 32, bos=1)
        without = perplexity.mechserve_perplexity(loaded.model, ids, 32)
    assert run["perplexity"] == pytest.approx(want["perplexity"]) and math.isfinite(run["perplexity"])
    assert want["perplexity"] != without["perplexity"]  # the chunks' first tokens were replaced


def test_ids_are_compared_to_the_first_difference() -> None:
    assert perplexity.compare_ids([1, 2, 3], [1, 2, 3]) == {
        "mechserve": 3,
        "llama_tokenize": 3,
        "identical": True,
        "first_difference": None,
    }
    assert perplexity.compare_ids([1, 2, 3], [1, 5, 3])["first_difference"] == 1
    assert perplexity.compare_ids([1, 2], [1, 2, 3])["first_difference"] == 2


def test_perplexity_refuses_a_block_mode_for_a_gguf_file(tmp_path, gguf_file, capsys) -> None:
    argv = ["bench", "perplexity", "--model", str(gguf_file), "--engine", "mechserve", "--mode", "q8_0"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "a GGUF file runs its weights as it stores them" in capsys.readouterr().err
