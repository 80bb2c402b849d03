"""Fixtures for the CLI tests: run ``mechserve`` in-process and capture what it printed."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_support import Result
from tiny_engines import tiny, tiny_dir, tiny_head, tiny_hf  # the torch CLI tests' tiny model (and a head for it)

from mechserve.cli.main import main

__all__ = ["cli", "spec_file", "tiny", "tiny_dir", "tiny_head", "tiny_hf"]

Cli = Callable[..., Result]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """``cli("run", "--json", ..., stdin=None)`` runs ``main`` and returns a ``Result``."""

    def run(*argv: str, stdin: str | None = None) -> Result:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = main(list(argv))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def spec_file(tmp_path: Path) -> Callable[[Any], str]:
    """``spec_file(obj)`` writes ``obj`` as JSON (or a str as is) and returns the path."""
    counter = iter(range(1_000_000))

    def write(obj: Any) -> str:
        path = tmp_path / f"workload-{next(counter)}.json"
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        return str(path)

    return write
