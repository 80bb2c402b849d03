"""The ``mechserve`` command: ``mechs``, ``demo``, ``run``, ``diff``, ``generate``, ``conform``, ``viz``, ``serve``, ``router``, ``bench`` and ``train-draft``.

Every problem, from a usage error to an engine exception part-way through a
run, is printed as one ``mechserve: error: ...`` line on stderr with exit
status 2 (departure D3).  Importing this module never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from mechserve import __version__
from mechserve.api.env import attention_mode, linear_mode, spec_costs_mode, suffix_tree_mode
from mechserve.api.errors import ModelLoadError
from mechserve.cli import bench, conform, demo, diff, lazy, mechs, router, run, serve, train_draft, viz
from mechserve.cli.errors import CliError, report
from mechserve.cli.parser import Parser
from mechserve.workload import WorkloadError

COMMANDS = (
    ("mechs", mechs, "list the mechanisms of the ladder and the question each answers"),
    ("demo", demo, "run the canned demo workload and print its step trace"),
    ("run", run, "run a workload (--spec FILE or --request flags) and print its step trace"),
    ("diff", diff, "show what one rung adds to another (a diff of their sources)"),
    ("generate", lazy, lazy.GENERATE_HELP),
    ("conform", conform, conform.HELP),
    ("viz", viz, viz.HELP),
    ("serve", serve, serve.HELP),
    ("router", router, router.HELP),
    ("bench", bench, bench.HELP),
    ("train-draft", train_draft, train_draft.HELP),
)
PASSTHROUGH = {"generate"}
# Set to get a traceback instead of the one-line report for unexpected errors.
TRACEBACK_ENV = "MECHSERVE_TRACEBACK"


def build_parser() -> Parser:
    """The top-level parser with one subparser per command."""
    parser = Parser(
        prog="mechserve", description="An LLM serving engine whose scheduler is an executable specification."
    )
    parser.add_argument("--version", action="version", version=f"mechserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, help_text in COMMANDS:
        sub = commands.add_parser(name, help=help_text, description=help_text, add_help=name not in PASSTHROUGH)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run, parser=sub)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; a pass-through command keeps the arguments it did not declare.

    Raises ``UsageError`` for anything argparse rejects.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in PASSTHROUGH:
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mechserve`` command line; return the exit status (0, or 2 on any error)."""
    try:
        check_utf8(sys.argv[1:] if argv is None else list(argv))
        args = parse(argv)
        if _runs_a_model(args, argv):
            try:
                attention_mode()  # a bad MECHSERVE_ATTENTION or MECHSERVE_LINEAR is a usage error, caught before any work
                linear_mode()
                spec_costs_mode()  # and MECHSERVE_SPEC_COSTS
                suffix_tree_mode()  # and MECHSERVE_SUFFIX_TREE
            except ValueError as exc:
                raise CliError(str(exc)) from None
        return int(args.handler(args) or 0)
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else report(str(exc.code))
    except (CliError, WorkloadError, ModelLoadError) as exc:  # a model that does not load is the user's error
        return report(str(exc))
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        return report("interrupted", code=130)
    except Exception as exc:
        if os.environ.get(TRACEBACK_ENV):
            raise
        return report(f"internal error: {type(exc).__name__}: {exc} (set {TRACEBACK_ENV}=1 for a traceback)")


def check_utf8(words: Sequence[str]) -> None:
    """Raise ``CliError`` naming the first argument that is not valid UTF-8 text.

    Python decodes an argument's undecodable bytes as lone surrogates (``caf\\xe9`` in Latin-1 becomes
    ``'caf\\udce9'``), which no tokenizer can take; every command refuses them here, once.
    """
    for i, word in enumerate(words):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(word[exc.start])
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
            flag = words[i - 1] if i and words[i - 1].startswith("--") and "=" not in words[i - 1] else None
            name = f"the value of {flag}" if flag else f"argument {i + 1}"
            shown = word.encode("utf-8", "surrogateescape" if what.startswith("byte") else "backslashreplace")
            raise CliError(
                f"{name} ('{shown.decode('ascii', 'backslashreplace')}') is not valid UTF-8: {what} at character "
                f"{exc.start}; give UTF-8 text (is the terminal's locale UTF-8?)"
            ) from None


def _runs_a_model(args: argparse.Namespace, argv: Sequence[str] | None) -> bool:
    """Whether this command runs a real model (so ``MECHSERVE_ATTENTION`` matters); never for ``--help``."""
    words = sys.argv[1:] if argv is None else list(argv)
    if "-h" in words or "--help" in words:
        return False
    return (
        args.command in ("generate", "serve", "bench", "conform", "train-draft")
        or getattr(args, "backend", None) == "torch"
    )


def _silence_stdout() -> None:
    """After the reader of stdout went away, send the rest of the output nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
