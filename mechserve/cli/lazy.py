"""``mechserve generate``: registered always, imported only when run.

The command's module (``mechserve.cli.generate``, which needs torch) exposes
``add_arguments(parser)`` and ``run(args)``.  The top-level parser only
reserves the name and passes every argument after it through, so the spec
commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from mechserve.cli.errors import CliError
from mechserve.cli.parser import Parser

GENERATE_MODULE = "mechserve.cli.generate"
GENERATE_HELP = "generate text with a real model (needs the torch extra)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Nothing: the arguments are the generate module's, parsed when the command runs."""


def load_generate() -> ModuleType:
    """Import the generate command's module.

    Raises ``CliError`` if it is not installed or a dependency (torch) is missing.
    """
    try:
        return importlib.import_module(GENERATE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == GENERATE_MODULE:
            raise CliError("the generate command is not available in this installation") from None
        raise CliError(f"generate needs {exc.name!r}: pip install 'mechserve[torch]'") from None


def run(args: argparse.Namespace) -> int:
    """Parse the passed-through arguments with the generate module's own parser and run it.

    Raises ``CliError`` as ``load_generate`` does, and ``UsageError`` for bad arguments.
    """
    module = load_generate()
    parser = Parser(prog="mechserve generate", description=GENERATE_HELP)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.passthrough)) or 0)
