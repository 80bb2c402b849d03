"""Every command the README shows works as written, on the README's own workload example."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def usage_commands() -> list[list[str]]:
    """The ``mechserve ...`` lines of the Usage section's bash block, comments stripped, as argv lists."""
    section = README.split("## Usage", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    commands = []
    for line in block.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "mechserve":
            commands.append(argv[1:])
    return commands


def readme_workload() -> dict:
    block = re.search(r"```json\n(.*?)```", README.split("### The workload spec", 1)[1], re.S)
    assert block is not None
    return json.loads(block.group(1))


COMMANDS = usage_commands()
SPEC_COMMANDS = [argv for argv in COMMANDS if argv[0] != "generate"]


def test_the_usage_block_shows_every_command() -> None:
    assert {argv[0] for argv in COMMANDS} == {"mechs", "demo", "run", "diff", "generate"}
    assert any("--mech" in argv for argv in COMMANDS)


@pytest.mark.parametrize("argv", SPEC_COMMANDS, ids=[" ".join(argv) for argv in SPEC_COMMANDS])
def test_usage_command_works_as_written(argv: list[str], cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workload.json").write_text(json.dumps(readme_workload()))
    result = cli(*argv)
    assert result.code == 0, result.err
    assert result.err == ""


@pytest.mark.parametrize("mech", ["m09", "m10", "m11", "m12"])
def test_the_readme_workload_runs_on_every_rung_with_speculation(mech: str, cli, spec_file) -> None:
    assert cli("run", "--spec", spec_file(readme_workload()), "--mech", mech).code == 0


def test_the_readme_says_what_lower_rungs_refuse(cli, spec_file) -> None:
    result = cli("run", "--spec", spec_file(readme_workload()), "--mech", "m05")
    assert result.code == 2 and "m05 has no speculative decoding" in result.err
    for words in ("before m09", "before m11", "before m12", "are clamped"):
        assert words in " ".join(README.split()), words


def test_the_readme_counts_the_rungs(cli) -> None:
    count = len(cli("mechs").lines)
    assert count == 17 and "the seventeen rungs" in README
