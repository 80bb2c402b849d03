"""An ``argparse`` parser whose usage errors are one line, not a usage dump (D3), and the engine flags
every real-model command shares (``--device``, ``--compile``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from mechserve.api.config import device_name
from mechserve.cli.errors import CliError


class UsageError(CliError):
    """The command line itself is wrong (unknown option, missing argument, bad value)."""


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` that raises ``UsageError`` instead of printing usage and exiting.

    ``main`` turns the error into one ``mechserve: error: ...`` line and exit
    status 2.  Subparsers made with ``add_subparsers`` are of this class too.
    """

    def error(self, message: str) -> NoReturn:
        """Raises ``UsageError`` carrying ``message`` (``--flag: ...``, without argparse's "argument ") and
        where to find help."""
        raise UsageError(f"{message.removeprefix('argument ')} (see '{self.prog} --help')")


def device_text(text: str) -> str:
    """An argparse ``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (its availability is checked
    where the engine is built, one error line naming it)."""
    try:
        return device_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def api_key(env: str | None = None) -> Callable[[str], str]:
    """An argparse ``type=`` for a key flag (``serve --api-key``, ``router --worker-api-key``): a key that is
    empty or only blanks is refused, since it would silently leave authentication off; ``env`` names the
    environment variable the flag's default comes from, for the message."""
    where = f" (the flag or ${env})" if env else ""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(
                f"an empty key would turn authentication off: give a non-empty key or leave it unset{where}"
            )
        return text

    return parse


def add_device_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--device`` and ``--compile`` (``EngineConfig.device``/``compile``), shared by generate, serve,
    run --backend torch and bench run; ``prefix`` starts their help (e.g. "with --backend torch: ")."""
    parser.add_argument(
        "--device",
        type=device_text,
        default=None,
        metavar="DEVICE",
        help=f"{prefix}cpu (default), cuda or cuda:N: where the weights, the KV pool and each step's tensors live",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help=f"{prefix}torch.compile each decoder layer's dense parts (compiles on the first steps; "
        "see docs/benchmarks.md for when it pays)",
    )
