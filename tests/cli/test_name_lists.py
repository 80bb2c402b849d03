"""``mechserve.cli.parser.names``: the one converter of a comma-separated list of names (bench run, fleet, perplexity)."""

from __future__ import annotations

import argparse

import pytest
from cli_support import assert_one_error_line

from mechserve.cli.parser import names

CONVERT = names("mode", ("exact", "fast", "q4_1"), every=("exact", "fast"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fast", ["fast"]),
        ("q4_1, exact", ["q4_1", "exact"]),  # the order given
        ("fast,fast,exact,fast", ["fast", "exact"]),  # each once
        ("fast,,", ["fast"]),
        ("all", ["exact", "fast"]),
    ],
)
def test_names_in_the_order_given_each_once(text: str, expected: list[str]) -> None:
    assert CONVERT(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("turbo", "unknown mode turbo; choose from exact, fast, q4_1"),
        ("fast,turbo,warp", "unknown mode turbo, warp; choose from exact, fast, q4_1"),
        (",", "unknown mode ','; choose from exact, fast, q4_1"),
        ("", "unknown mode ''; choose from exact, fast, q4_1"),
    ],
)
def test_an_unknown_or_missing_name_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        CONVERT(text)
    assert str(caught.value) == message


def test_all_is_a_name_only_where_it_means_every_one() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="unknown engine all"):
        names("engine", ("a", "b"))("all")


@pytest.mark.parametrize(
    ("argv", "flag", "needle"),
    [
        (["bench", "run", "--workload", "bogus"], "--workload", "unknown workload bogus; choose from"),
        (["bench", "run", "--engine", "mechserve,nope"], "--engine", "unknown engine nope; choose from"),
        (["bench", "run", "--mode", "turbo"], "--mode", "unknown mode turbo; choose from exact, fast"),
        (["bench", "fleet", "--workloads", "chat"], "--workloads", "unknown workload chat; choose from"),
        (["bench", "fleet", "--policies", "fastest"], "--policies", "unknown policy fastest; choose from"),
        (["bench", "perplexity", "--mode", "f16"], "--mode", "unknown mode f16; choose from"),
        (["bench", "perplexity", "--engine", "vllm"], "--engine", "unknown engine vllm; choose from"),
    ],
)
def test_every_name_list_flag_refuses_in_one_line(cli, argv: list[str], flag: str, needle: str) -> None:
    assert_one_error_line(cli(*argv), f"{flag}: {needle}")
