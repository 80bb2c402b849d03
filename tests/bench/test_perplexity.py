"""``mechserve bench perplexity`` without llama.cpp: chunk scoring, chunking, the tool's output line,
a tiny model's perplexity against transformers' logits, and the CLI's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import VOCAB, save_tiny, save_word_tokenizer, tiny_config, words

from mechserve.bench import perplexity
from mechserve.cli.main import main


def test_uniform_logits_score_log_vocab_on_the_second_half() -> None:
    ctx, vocab = 10, 7
    total, count = perplexity.chunk_scores(torch.zeros(ctx, vocab), torch.arange(ctx) % vocab, ctx)
    assert count == ctx // 2 - 1  # positions 5..8 predict tokens 6..9
    assert total == pytest.approx(count * math.log(vocab))


def test_the_logits_at_i_score_the_token_at_i_plus_one() -> None:
    ctx, vocab = 8, 5
    tokens = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    right = torch.full((ctx, vocab), -50.0)
    right[torch.arange(ctx - 1), tokens[1:]] = 50.0  # row i sure of token i + 1
    wrong = torch.full((ctx, vocab), -50.0)
    wrong[torch.arange(ctx), tokens] = 50.0  # row i sure of token i
    assert perplexity.chunk_scores(right, tokens, ctx)[0] == pytest.approx(0.0, abs=1e-9)
    assert perplexity.chunk_scores(wrong, tokens, ctx)[0] == pytest.approx(3 * 100.0, rel=1e-6)


@given(ctx=st.integers(1, 300), rows=st.one_of(st.none(), st.integers(1, 300)))
def test_the_pieces_cover_the_chunk_in_order(ctx: int, rows: int | None) -> None:
    pieces = perplexity.chunk_pieces(ctx, rows)
    assert [s for s, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert sum(n for _, n in pieces) == ctx
    assert all(1 <= n <= (rows or ctx) for _, n in pieces)


def test_llama_perplexity_final_line_is_read() -> None:
    out = "[1]18.1,[2]19.9,\nFinal estimate: PPL = 20.9300 +/- 2.32870\n\nllama_perf_context_print: ..."
    assert perplexity.parse_llama_perplexity(out) == (20.93, 2.3287)
    assert perplexity.parse_llama_perplexity("main: error: failed to load model") is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ppl-tiny")
    save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    return path


def _reference(hf: torch.nn.Module, ids: list[int], ctx: int) -> float:
    total, count = 0.0, 0
    for c in range(len(ids) // ctx):
        tokens = torch.tensor(ids[c * ctx : (c + 1) * ctx])
        with torch.no_grad():
            logits = hf(tokens[None]).logits[0].float()
        s, n = perplexity.chunk_scores(logits, tokens, ctx)
        total, count = total + s, count + n
    return math.exp(total / count)


@pytest.mark.parametrize("rows", [None, 3, 16])
def test_a_tiny_models_perplexity_is_transformers_one_whatever_the_rows_per_forward(
    tiny_dir: Path, rows: int | None
) -> None:
    from transformers import AutoModelForCausalLM

    from mechserve.model.loader import load_model

    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    loaded = load_model(str(tiny_dir), tokenizer=False)
    with torch.inference_mode():
        got = perplexity.mechserve_perplexity(loaded.model, ids, 32, rows)
    assert got["chunks"] == 2 and got["scored_tokens"] == 2 * 15
    assert got["perplexity"] == pytest.approx(_reference(hf, ids, 32), rel=1e-5)


def test_a_text_shorter_than_one_chunk_is_refused(tiny_dir: Path) -> None:
    from mechserve.model.loader import load_model

    loaded = load_model(str(tiny_dir), tokenizer=False)
    with pytest.raises(ValueError, match="fewer than one chunk of 32"):
        perplexity.mechserve_perplexity(loaded.model, list(range(31)), 32)


def test_cli_writes_every_mode_and_skips_llama_cpp_with_one_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(words(torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()))
    argv = ["bench", "perplexity", "--model", str(tiny_dir), "--text", str(text), "--ctx", "16"]
    assert main([*argv, "--mode", "exact,fast", "--rows", "4", "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("llama-cpp skipped") == 1
    doc = json.loads((tmp_path / "out" / "perplexity.json").read_text())
    assert [(r["engine"], r["mode"]) for r in doc["runs"]] == [("mechserve", "exact"), ("mechserve", "fast")]
    assert doc["tokens"] == 40 and all(r["chunks"] == 2 and r["rows_per_forward"] == 4 for r in doc["runs"])
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in doc["runs"])
    assert doc["skipped"] == [
        {"engine": "llama-cpp", "reason": "llama-cpp skipped: the embedded model or a GGUF file only"}
    ]
    assert "perplexity mechserve exact" in captured.out


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--ctx", "7"], "--ctx"),
        (["--ctx", "16", "--rows", "0"], "--rows"),
        (["--ctx", "16", "--rows", "17"], "--rows"),
        (["--text", "/nonexistent/text.txt"], "--text"),
        (["--mode", "int3"], "mode"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    extra: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "perplexity", "--engine", "mechserve", "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
