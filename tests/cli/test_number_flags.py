"""Every number flag of every command goes through ``mechserve.cli.parser.Bounded``: one converter, one message.

The flags are found by walking the parsers (``mechserve``'s, with every subcommand and benchmark, and
``generate``'s own), so a flag added later with ``Bounded`` is covered without touching this file.
"""

from __future__ import annotations

import argparse
import math
import re

import pytest
from cli_support import Result, assert_one_error_line

from mechserve.cli import generate
from mechserve.cli.main import build_parser
from mechserve.cli.parser import Bounded, Parser

# The commands whose number flags were each their own converter once; the walk must still find them all.
COMMANDS = {
    "generate",
    "serve",
    "router",
    "conform",
    "train-draft",
    "bench run",
    "bench fleet",
    "bench serve",
    "bench spec-decode",
    "bench structured",
    "bench compile",
}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _walk(sub, (*path, name))
        elif isinstance(action.type, Bounded):
            found.append((path, action))
    return found


def _number_flags() -> list[tuple[tuple[str, ...], argparse.Action]]:
    own = Parser(prog="mechserve generate")  # generate's flags are parsed by the command itself (cli/lazy.py)
    generate.add_arguments(own)
    return _walk(build_parser(), ()) + _walk(own, ("generate",))


def _out_of_range(bounds: Bounded) -> str:
    """A value just outside ``bounds`` (below its lower bound, else above its upper one), or a word."""
    step = 1 if bounds.kind is int else 0.5
    if bounds.ge is not None:
        return str(bounds.kind(bounds.ge) - step)
    if bounds.gt is not None:
        return str(bounds.kind(bounds.gt))
    if bounds.le is not None:
        return str(bounds.kind(bounds.le) + step)
    return "inf" if bounds.finite else "x"


FLAGS = _number_flags()
CASES = [
    pytest.param(path, action, value, id=f"{' '.join(path)} {action.option_strings[-1]} {value}")
    for path, action in FLAGS
    for value in dict.fromkeys((_out_of_range(action.type), "x", "nan"))
]


def test_the_walk_finds_every_command_with_number_flags() -> None:
    assert {" ".join(path) for path, _ in FLAGS} >= COMMANDS


@pytest.mark.parametrize(("path", "action", "value"), CASES)
def test_a_bad_number_is_one_line_naming_the_flag(
    cli, path: tuple[str, ...], action: argparse.Action, value: str
) -> None:
    flag = max(action.option_strings, key=len)
    result: Result = cli(*path, flag, value)
    bounds = action.type
    assert isinstance(bounds, Bounded)
    assert_one_error_line(result, f"{'/'.join(action.option_strings)}: expected {bounds.expected}, got '{value}'")


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        (Bounded(int, ge=1), "an integer >= 1"),
        (Bounded(int, ge=1, le=64), "an integer in [1, 64]"),
        (Bounded(int, le=9), "an integer <= 9"),
        (Bounded(int), "an integer"),
        (Bounded(float, gt=0), "a number > 0"),
        (Bounded(float, gt=0, le=86_400, unit="seconds"), "a number of seconds in (0, 86400]"),
        (Bounded(float, ge=0.05, le=24 * 60, unit="minutes"), "a number of minutes in [0.05, 1440]"),
        (Bounded(float, ge=1e-7, le=1.0), "a number in [1e-07, 1]"),
        (Bounded(float, finite=True), "a finite number"),
        (Bounded(int, ge=-(1 << 63)), "an integer >= -9223372036854775808"),
    ],
)
def test_the_message_says_the_bounds_given(bounds: Bounded, expected: str) -> None:
    assert bounds.expected == expected
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        bounds("x")
    assert str(caught.value) == f"expected {expected}, got 'x'"


@pytest.mark.parametrize(
    ("bounds", "good", "bad"),
    [
        (Bounded(int, ge=1, le=64), ["1", "64", " 7 ", "01"], ["0", "65", "1.5", "1e3", "", "nan"]),
        (Bounded(float, gt=0), ["1e-300", "0.5", "inf", "1e400"], ["0", "-0.0", "-1", "nan", "NaN", "-inf"]),
        (Bounded(float, ge=0, le=1), ["0", "1", "0.3"], ["-1e-9", "1.0000001", "inf", "nan"]),
        (Bounded(float, finite=True), ["-3", "0", "1e308"], ["inf", "-inf", "1e400", "nan"]),
    ],
)
def test_values_inside_pass_and_outside_are_refused(bounds: Bounded, good: list[str], bad: list[str]) -> None:
    for text in good:
        value = bounds(text)
        assert isinstance(value, bounds.kind) and not math.isnan(value)  # type: ignore[arg-type]
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"got {text!r}") + "$"):
            bounds(text)


def test_one_lower_bound_at_most() -> None:
    with pytest.raises(ValueError, match="at most one lower bound"):
        Bounded(int, ge=0, gt=0)
