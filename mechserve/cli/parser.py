"""An ``argparse`` parser whose usage errors are one line, not a usage dump (D3)."""

from __future__ import annotations

import argparse
from typing import NoReturn

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
