"""``engine_config(args)``: every command's engine flags become one ``EngineConfig`` in one place, and every
engine size's range is ``api/config.py``'s ``check_setting`` (issue 25, item 5)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mechserve.api.config import EngineConfig, SpeculativeConfig, check_setting, setting_range
from mechserve.cli.engine_args import engine_config, setting
from mechserve.cli.errors import CliError
from mechserve.cli.parser import Parser
from mechserve.cli.vllm_names import resolve

ROOT = Path(__file__).resolve().parents[2] / "mechserve"


def parsed(command: str, argv: list[str]) -> argparse.Namespace:
    import importlib

    module = importlib.import_module(f"mechserve.cli.{command}")
    parser = Parser(prog=f"mechserve {command}")
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_generate_flags_become_the_config() -> None:
    args = parsed("generate", ["hi", "--page-size", "8", "--num-pages", "40", "--spec-len", "2", "--seed", "5"])
    config = engine_config(args, ignore=("seed",))
    assert (config.page_size, config.num_pages, config.spec_len, config.seed) == (8, 40, 2, EngineConfig().seed)
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2)


def test_serve_flags_become_the_config() -> None:
    args = parsed(
        "serve",
        [
            "--max-running",
            "3",
            "--no-output-caching",
            "--no-hold-shared-prefix",
            "--seed",
            "9",
            "--max-model-len",
            "64",
        ],
    )
    resolve(args)  # vLLM's spellings beside ours, as serve resolves them first
    config = engine_config(args)
    assert (config.max_running, config.max_waiting, config.seed, config.max_model_len) == (3, 256, 9, 64)
    assert not config.output_caching and not config.hold_shared_prefix and config.prefix_caching
    assert config.max_step_tokens == 512


def test_a_value_the_config_refuses_names_the_flag() -> None:
    args = parsed("generate", ["hi", "--num-pages", "1000000", "--page-size", "64"])
    with pytest.raises(CliError, match=r"^--num-pages: num_pages 1000000 x page_size 64 = .* 16777216 slots"):
        engine_config(args)
    with pytest.raises(CliError, match="--spec-method draft needs --draft-model"):
        engine_config(parsed("generate", ["hi", "--spec-method", "draft"]))


@pytest.mark.parametrize("name", ["page_size", "num_pages", "max_step_tokens", "spec_len", "world_size"])
def test_one_range_check_for_the_config_and_the_flags(name: str) -> None:
    least, most = setting_range(name)
    for bad in (least - 1, most + 1):
        with pytest.raises(ValueError) as from_config:
            check_setting(name, bad)
        with pytest.raises(argparse.ArgumentTypeError) as from_flag:
            setting(name)(str(bad))
        assert str(from_flag.value) == str(from_config.value)
        with pytest.raises(ValueError, match=f"^{name}: {re.escape(str(from_config.value))}$"):
            EngineConfig(**{name: bad})
    assert setting(name)(str(most)) == most


def test_no_command_builds_an_engine_config_of_its_own() -> None:
    """generate, serve, run --backend torch and bench run build their settings through ``engine_config``."""
    for rel in ("cli/generate.py", "cli/serve.py", "cli/run.py", "bench/run.py", "bench/runners.py"):
        text = (ROOT / rel).read_text()
        assert "EngineConfig(" not in text, rel
