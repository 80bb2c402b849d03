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


def engine_failure(exc: BaseException, step_counter: int) -> str:
    """The error line for an exception out of a spec engine's ``run``, shared by ``run`` and ``generate``.

    A ``RuntimeError("never fits: ...")`` is the check of m02/m03, which
    ``run()`` raises after the step it judges (MECHANISMS 3): ``never fits
    after step N: ...``.  Everything else is raised inside the step the counter names:
    ``Irreducible during step 2: ...``.
    """
    message = " ".join(str(exc).split())
    if isinstance(exc, RuntimeError) and message.startswith("never fits"):
        return f"never fits after step {step_counter - 1}: {message.removeprefix('never fits: ')}"
    return f"{type(exc).__name__} during step {step_counter}: {message}"
