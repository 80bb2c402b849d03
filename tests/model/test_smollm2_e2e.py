"""End to end on the embedded SmolLM2-135M: our engine's greedy ids equal transformers' own ``generate``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import run_engine as generate

from mechserve.api.config import EngineConfig
from mechserve.cli.main import main
from mechserve.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are red, yellow and",
]
NEW = 24


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def reference(smollm2: LoadedModel) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt, batch 1, fp32, from the same converted weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()
    assert hf.config.model_type == "llama" and hf.config.num_hidden_layers == 30
    out: dict[str, list[int]] = {}
    for prompt in PROMPTS:
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        out[prompt] = seq[0, ids.shape[1] :].tolist()
    return out


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(max_step_tokens=7, page_size=4, spec_len=3),
    ],
    ids=["default", "chunked-spec"],
)
def test_greedy_ids_equal_transformers(smollm2: LoadedModel, reference: dict[str, list[int]], config: Any) -> None:
    result = generate(
        smollm2.model, PROMPTS, NEW, tokenizer=smollm2.tokenizer, eos_token_ids=smollm2.eos_token_ids, config=config
    )
    for prompt, done in zip(PROMPTS, result.completions):
        assert list(done.token_ids) == reference[prompt], prompt
        assert done.text == smollm2.tokenizer.decode(reference[prompt])


def test_cli_json(reference: dict[str, list[int]], capsys: pytest.CaptureFixture[str]) -> None:
    prompt = PROMPTS[0]
    assert main(["generate", prompt, "--max-tokens", str(NEW), "--json"]) == 0
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert final["outputs"][0]["token_ids"] == reference[prompt]
    assert final["summary"][0]["generated"] == NEW


def test_cli_quiet_is_the_text(smollm2: LoadedModel, reference: dict[str, list[int]], capsys) -> None:
    prompt = PROMPTS[2]
    assert main(["generate", prompt, "--max-tokens", str(NEW), "-q"]) == 0
    assert capsys.readouterr().out == smollm2.tokenizer.decode(reference[prompt]) + "\n"


def test_readme_generate_command(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    # the Usage block's (the Speculative decoding section's own are run by test_readme_spec)
    line = next(line for line in readme.splitlines() if line.startswith("mechserve generate "))
    argv = shlex.split(line, comments=True)
    assert main(argv[1:]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "prefill" in last and "decode" in last and "finished" in last


def test_prompt_past_the_context_is_rejected(smollm2: LoadedModel, capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2's max_position_embeddings is 8192: nothing past it is ever computed (no silent garbage)."""
    prompt = "word " * 8200
    assert main(["generate", prompt, "--max-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("mechserve: error: request rejected: TOO_LONG") and "context of 8192 positions" in err
