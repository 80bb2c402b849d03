"""``mechserve generate`` through its ``add_arguments``/``run`` pair, on a tiny model with a word tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mechserve.cli import generate as generate_cli

from .conftest import VOCAB, hf_greedy, save_tiny, tiny_config


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="mechserve generate")
    generate_cli.add_arguments(parser)
    rc = generate_cli.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    hf = save_tiny(path, tiny_config())
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path, hf


PROMPT = "w3 w14 w15 w92 w65 w35 w89 w79 w32 w38 w46 w26 w43 w38 w32 w79 w50 w28"


def test_text_trace_then_text(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "6", "--max-step-tokens", "8"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("step   0  scheduled r0  executed r0=8")
    assert "sampled" not in lines[0]  # a chunk inside the prompt samples nothing
    assert any("finished r0=LENGTH" in line for line in lines)
    assert lines[-2].startswith(PROMPT) and len(lines[-2].split()) == len(PROMPT.split()) + 6
    assert "6 token(s)" in lines[-1]


def test_json_matches_transformers(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, hf = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "9", "--spec-len", "2", "--json"], capsys)
    assert rc == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    steps, final = objs[:-1], objs[-1]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert all("tokens" in s and "accepted" in s for s in steps)
    prompt_ids = [int(w[1:]) for w in PROMPT.split()]
    assert final["token_ids"] == hf_greedy(hf, prompt_ids, 9)
    assert final["text"] == "".join(f" w{i}" for i in final["token_ids"])
    assert final["request_id"] == "r0" and final["finish_reason"] == "LENGTH" and final["generated"] == 9
    assert [t for s in steps for t in s["tokens"].get("r0", [])] == final["token_ids"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "/no/such/dir"], "model directory not found: /no/such/dir"),
        (["--page-size", "0"], "page_size must be > 0"),
        (["--max-step-tokens", "-1"], "max_step_tokens must be > 0"),
        (["--num-pages", "0"], "num_pages must be > 0"),
        (["--spec-len", "-2"], "spec_len must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--num-pages", "2", "--page-size", "4"], "needs 5 page(s) but the pool has 2"),
    ],
)
def test_errors_are_one_line(
    extra: list[str], message: str, tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = tiny_dir
    argv = [PROMPT, "--model", str(path), *extra] if "--model" not in extra else [PROMPT, *extra]
    rc, _, err = call(argv, capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("mechserve: error: ") and message in err, err
    assert "Traceback" not in err


def test_unsupported_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    rc, _, err = call(["hi", "--model", str(tmp_path)], capsys)
    assert rc == 2 and err.startswith("mechserve: error: unsupported architecture 'bert'")
