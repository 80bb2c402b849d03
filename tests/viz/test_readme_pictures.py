"""The README's picture section works as written, and its picture is the demo's."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from .conftest import Cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def picture_commands() -> list[list[list[str]]]:
    """The spec ``mechserve`` pipelines of the "Pictures of a trace" block, each a list of argv lists."""
    section = README.split("### Pictures of a trace", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    pipelines = []
    for line in block.group(1).splitlines():
        stages = [shlex.split(stage, comments=True) for stage in line.split("|")]
        if stages[0] and stages[0][0] == "mechserve" and stages[0][1] != "generate":
            pipelines.append([argv[1:] for argv in stages])
    return pipelines


PIPELINES = picture_commands()


def test_the_section_shows_every_way_in() -> None:
    flat = [" ".join(argv) for pipeline in PIPELINES for argv in pipeline]
    assert any("--viz demo.html" in c for c in flat) and any("--plot" in c for c in flat)
    assert any(c.startswith("viz -") for c in flat) and "generate" in README.split("### Pictures of a trace")[1]


@pytest.mark.parametrize("pipeline", PIPELINES, ids=[" | ".join(" ".join(a) for a in p) for p in PIPELINES])
def test_picture_command_works_as_written(
    pipeline: list[list[str]], cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    workload = re.search(r"```json\n(.*?)```", README.split("### The workload spec", 1)[1], re.S)
    assert workload is not None
    (tmp_path / "workload.json").write_text(json.dumps(json.loads(workload.group(1))))
    if pipeline[0][0] == "viz":  # it reads what the line above it wrote
        assert cli("run", "--spec", "workload.json", "--viz", "trace.json").code == 0
    stdin = None
    for argv in pipeline:
        result = cli(*argv, stdin=stdin)
        assert result.code == 0, result.err
        stdin = result.out
    written = [a for argv in pipeline for a in argv if Path(a).suffix in (".html", ".png", ".svg", ".json")]
    for name in written:
        if name != "workload.json":
            assert (tmp_path / name).stat().st_size > 1000, name


def test_the_readme_shows_the_demo_picture_that_make_draws(cli: Cli, tmp_path: Path) -> None:
    top = README.split("## Usage", 1)[0]
    assert "](docs/demo-trace.png)" in top
    assert "viz-readme:" in (ROOT / "Makefile").read_text() and "demo --plot docs/demo-trace.png" in top
    drawn = tmp_path / "demo-trace.png"
    assert cli("demo", "--plot", str(drawn)).code == 0
    # Same size, not same bytes: another matplotlib may place a pixel differently.
    committed = (ROOT / "docs" / "demo-trace.png").read_bytes()
    assert drawn.read_bytes()[16:24] == committed[16:24], "the demo's picture changed shape: run make viz-readme"
