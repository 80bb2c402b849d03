"""How the ``mechserve`` command reports problems: one line on stderr, exit status 2 (D3)."""

from __future__ import annotations

import sys

EXIT_ERROR = 2


class CliError(Exception):
    """A problem to report as one ``mechserve: error: ...`` line; the command exits with status 2."""


def report(message: str, code: int = EXIT_ERROR) -> int:
    """Print ``mechserve: error: <message>`` as one line on stderr and return ``code``."""
    line = " ".join(str(message).split()) or "unknown error"
    print(f"mechserve: error: {line}", file=sys.stderr, flush=True)
    return code
