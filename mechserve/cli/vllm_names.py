"""vLLM's spellings of our flags: ``mechserve serve smollm2 --max-num-seqs 8`` means ``--model smollm2 --max-running 8``.

Each setting has our flag and ``vllm serve``'s, both parsed into their own destinations with no
default; ``resolve`` then gives the setting the value of whichever was given (both with the same
value is fine), its default if neither was, and raises ``CliError`` when both were given with
different values::

    ours                    vLLM's
    --model M               M (positional)
    --max-running N         --max-num-seqs N
    --max-step-tokens N     --max-num-batched-tokens N
    --page-size N           --block-size N
    --world-size N          --tensor-parallel-size N, -tp N
    --no-prefix-caching     --no-enable-prefix-caching (and --enable-prefix-caching)

Importing this module is cheap (argparse only); ``--chat-template`` (a file or an inline
template, vLLM's flag under vLLM's name) is here too, shared by ``serve`` and ``generate``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechserve.cli.errors import CliError

_SUFFIX = "_vllm"
MAX_TEMPLATE_BYTES = 1 << 20  # a --chat-template file (real ones are a few KiB; /dev/zero never ends)


@dataclass(frozen=True, slots=True)
class Alias:
    """One setting under two names: ``dest`` (ours, shown as ``ours``) and vLLM's (shown as ``theirs``)."""

    dest: str
    ours: str
    theirs: str
    default: Any


def add_aliased(
    parser: argparse.ArgumentParser, ours: str, theirs: tuple[str, ...], *, dest: str, default: Any, **kwargs: Any
) -> None:
    """Add our flag ``ours`` and vLLM's ``theirs`` (one or more spellings) for the setting ``dest``; both take
    ``kwargs`` (``type=``, ``metavar=``, ``help=`` for ours).  ``resolve`` fills in ``default``."""
    help_text = kwargs.pop("help", None)
    parser.add_argument(ours, dest=dest, default=None, help=help_text, **kwargs)
    parser.add_argument(*theirs, dest=dest + _SUFFIX, default=None, help=f"vLLM's name for {ours}", **kwargs)
    _register(parser, Alias(dest, ours, theirs[0], default))


def add_model_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--model M`` and vLLM's positional ``M`` (``mechserve serve smollm2``); default ``smollm2``."""
    parser.add_argument("--model", dest="model", default=None, help=help_text)
    parser.add_argument("model" + _SUFFIX, nargs="?", default=None, metavar="MODEL", help="vLLM's place for --model")
    _register(parser, Alias("model", "--model", "MODEL (the positional model)", "smollm2"))


def add_prefix_caching_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-prefix-caching`` and vLLM's ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``."""
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_const",
        const=False,
        default=None,
        help="neither reuse nor publish prompt pages",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching" + _SUFFIX,
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's names: --no-enable-prefix-caching is --no-prefix-caching (on by default)",
    )
    _register(parser, Alias("prefix_caching", "--no-prefix-caching", "--enable-prefix-caching", True))


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Give each aliased setting its one value (idempotent); ``CliError`` for two names with two values."""
    for alias in getattr(args, "vllm_aliases", ()):
        ours = getattr(args, alias.dest, None)
        theirs = getattr(args, alias.dest + _SUFFIX, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise CliError(
                f"{_shown(alias.theirs, theirs)} and {_shown(alias.ours, ours)} set the same thing; give one of them"
            )
        value = ours if ours is not None else theirs
        setattr(args, alias.dest, alias.default if value is None else value)
        setattr(args, alias.dest + _SUFFIX, None)
    return args


def _shown(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return ("--" if value else "--no-") + flag.removeprefix("--no-").removeprefix("--")
    return f"{flag} {value}"


def _register(parser: argparse.ArgumentParser, alias: Alias) -> None:
    parser.set_defaults(vllm_aliases=(*(parser.get_default("vllm_aliases") or ()), alias))


def chat_template(text: str) -> str:
    """An argparse ``type=`` for ``--chat-template``: the Jinja text of a file, or the value itself when it is
    an inline template (it has ``{{`` or ``{%``); ``ArgumentTypeError`` for a path that names no file, or a
    file over ``MAX_TEMPLATE_BYTES`` (read no further: ``/dev/zero`` ends there)."""
    path = Path(text)
    if "{{" not in text and "{%" not in text:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_TEMPLATE_BYTES + 1)
            if len(data) > MAX_TEMPLATE_BYTES:
                raise ValueError(f"it is over {MAX_TEMPLATE_BYTES >> 20} MiB, the most a chat template may be")
            return data.decode("utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise argparse.ArgumentTypeError(
                f"cannot read the chat template file {text!r}: {reason} (an inline template has {{{{ or {{%)"
            ) from None
    return text


def add_chat_template_argument(parser: argparse.ArgumentParser, applies_to: str) -> None:
    parser.add_argument(
        "--chat-template",
        type=chat_template,
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help=f"a Jinja chat template, a file or inline, instead of the model's (for {applies_to})",
    )


def apply_chat_template_flag(tokenizer: Any, template: str | None) -> None:
    """Make ``--chat-template`` the tokenizer's chat template; ``CliError`` if it cannot render a chat."""
    if template is None:
        return
    from mechserve.entrypoints.prompts import set_chat_template

    try:
        set_chat_template(tokenizer, template)
    except ValueError as exc:
        raise CliError(f"--chat-template: {exc}") from None
