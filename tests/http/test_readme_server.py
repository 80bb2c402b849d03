"""The README's Serving section works as written: its commands parse, its curl and openai examples run against a
server (the tiny model, served under the README's model name), and its ``AsyncLLM`` example runs on SmolLM2."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from server_support import serving

from mechserve.cli.main import parse
from mechserve.entrypoints.async_llm import AsyncLLM

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "README.md").read_text(encoding="utf-8").split("## Serving", 1)[1].split("\n## ", 1)[0]
README_URL = "http://127.0.0.1:8000"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", SECTION, re.S)


def python_block(word: str) -> str:
    """The section's one python example that holds ``word``."""
    (found,) = [b for b in blocks("python") if word in b]
    return found


def test_the_section_has_the_examples() -> None:
    assert len(blocks("bash")) == 3 and len(blocks("python")) == 5
    assert "mechserve serve" in blocks("bash")[0] and "curl" in blocks("bash")[1] and "lm_eval" in blocks("bash")[2]
    assert "from openai import OpenAI" in blocks("python")[0] and "AsyncLLM" in python_block("AsyncLLM")
    assert "tool_choice" in python_block("tools=")
    assert "previous_response_id" in python_block("responses.create")
    assert "import anthropic" in python_block("messages.create")


def test_the_commands_parse() -> None:
    (serve,) = [shlex.split(line, comments=True) for line in blocks("bash")[0].splitlines() if line.strip()]
    args = parse(serve[1:])
    assert args.command == "serve" and args.port == 8000 and args.host == "127.0.0.1"
    bench = re.search(r"`(mechserve bench serve [^`]*)`", SECTION)
    assert bench is not None
    args = parse(shlex.split(bench.group(1))[1:])
    assert args.command == "bench" and args.rate == 4 and args.num_requests == 64


@pytest.fixture(scope="module")
def readme_server(tiny):
    with serving(AsyncLLM(tiny, page_size=4, num_pages=128, model_name="smollm2")) as served:
        yield served


def test_the_lm_eval_command_parses_and_names_a_shipped_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command itself runs in tests/http/test_lm_eval.py (e2e), through lm-eval's Python API."""
    from lm_eval._cli import HarnessCLI

    cd, command = blocks("bash")[2].replace("\\\n", " ").split("&&")
    assert cd.split() == ["cd", "tests/data/lm_eval"]
    argv = shlex.split(command.replace("$HOME", "/home"))
    assert argv[0] == "lm_eval"
    monkeypatch.setattr("sys.argv", argv)
    args = HarnessCLI().parse_args()
    assert args.model == "local-completions" and args.include_path == "."
    for task in args.tasks:
        assert (ROOT / "tests" / "data" / "lm_eval" / f"{task}.yaml").is_file()
    from mechserve.model import checkpoint

    model_args = args.model_args
    assert (model_args["model"], model_args["base_url"]) == ("smollm2", README_URL + "/v1/completions")
    assert model_args["tokenizer"] == f"/home/.cache/mechserve/{checkpoint._CONVERTED_NAME}"  # the default cache


def test_the_curl_examples_run(readme_server) -> None:
    script = "set -e -o pipefail\n" + blocks("bash")[1].replace(README_URL, readme_server.url)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"object":"text_completion"' in result.stdout
    assert "data: [DONE]" in result.stdout and '"object":"chat.completion.chunk"' in result.stdout
    assert "vllm:time_to_first_token_seconds_count" in result.stdout


def test_the_openai_example_runs(readme_server) -> None:
    code = blocks("python")[0].replace(README_URL, readme_server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip()


def test_the_responses_example_runs(readme_server) -> None:
    code = python_block("responses.create").replace(README_URL, readme_server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    cached = int(out.getvalue().split()[-1])
    assert cached > 0, "the continued conversation came from the prefix cache"


def test_the_anthropic_example_runs(readme_server) -> None:
    code = python_block("messages.create").replace(README_URL, readme_server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    words = out.getvalue().split()
    assert words[-2] in ("end_turn", "max_tokens") and int(words[-1]) > 0


@pytest.mark.e2e
def test_the_async_llm_example_runs_on_smollm2() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(python_block("AsyncLLM"), "README.md", "exec"), {"__name__": "__main__"})
    assert "Paris" in out.getvalue()


@pytest.mark.e2e
def test_the_tool_call_example_runs_on_smollm2(smollm2) -> None:
    """The two-turn tool example against SmolLM2 itself (a random model would not name the city)."""
    with serving(AsyncLLM(smollm2, num_pages=256, model_name="smollm2")) as served:
        code = python_block("tools=").replace(README_URL, served.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
    first = out.getvalue().splitlines()[0]
    assert first == "tool_calls get_weather {'city': 'Paris'}", out.getvalue()
