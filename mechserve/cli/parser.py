"""An ``argparse`` parser whose usage errors are one line, not a usage dump (D3), the argparse types every
command shares (``Bounded``: a number in a range; ``names``: a comma-separated list of names; ``device_text``, ``api_key``), and the engine flags every
real-model command shares (``--device``, ``--compile``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Generic, NoReturn, TypeVar

from mechserve.api.config import device_name
from mechserve.cli.errors import CliError

Number = TypeVar("Number", int, float)


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


@dataclass(frozen=True)
class Bounded(Generic[Number]):
    """An argparse ``type=``: an ``int`` or ``float`` (``kind``) within the bounds given (``ge``: at least,
    ``gt``: above, ``le``: at most; pydantic's names); every command's one converter of a number flag.

    A value that is not a number of that kind, is NaN, is infinite while ``finite`` is set, or lies outside
    the bounds raises ``argparse.ArgumentTypeError`` with one message in one form, which ``Parser`` prints
    as ``--flag: expected an integer in [1, 64], got '0'`` (``>= 1``, ``> 0``, ``in (0, 86400]``: the
    bounds given; ``unit`` names what the number counts: ``a number of seconds``).  Without an upper bound
    (and without ``finite``) ``inf`` is a number like any other (``bench serve --rate inf``: all at once).
    ``Bounded(int, ge=1, le=64)``, ``Bounded(float, gt=0, unit="seconds")``; raises ``ValueError`` for two
    lower bounds.
    """

    kind: Callable[[str], Number]
    _: KW_ONLY
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    unit: str = ""
    finite: bool = False

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None:
            raise ValueError("give at most one lower bound (ge or gt)")

    @property
    def expected(self) -> str:
        """What the flag takes, as the message says it: ``an integer in [1, 64]``, ``a number of seconds > 0``."""
        noun = "an integer" if self.kind is int else "a finite number" if self.finite else "a number"
        if self.unit:
            noun = f"{noun} of {self.unit}"
        return f"{noun} {_range_text(self.ge, self.gt, self.le)}".rstrip()

    def __call__(self, text: str) -> Number:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}") from None
        if (
            value != value  # NaN compares unequal to everything, itself included
            or (self.finite and math.isinf(value))
            or (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        ):
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}")
        return value


def names(kind: str, allowed: Sequence[str], every: Sequence[str] | None = None) -> Callable[[str], list[str]]:
    """An argparse ``type=``: comma-separated names of ``allowed`` (``run,prefix``), at least one, each kept once in
    the order given; with ``every``, the word ``all`` stands for those.  Anything else raises
    ``argparse.ArgumentTypeError``: ``unknown workload chat; choose from tenants, multiturn, rag, uniform``."""

    def convert(text: str) -> list[str]:
        if every is not None and text == "all":
            return list(every)
        given = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in given if n not in allowed]
        if bad or not given:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(bad) or repr(text)}; choose from {', '.join(allowed)}"
            )
        return list(dict.fromkeys(given))

    return convert


def _range_text(ge: float | None, gt: float | None, le: float | None) -> str:
    """``in [1, 64]``, ``in (0, 86400]``, ``>= 1``, ``> 0``, ``<= 9`` or nothing, for ``Bounded``'s message."""
    low = ge if ge is not None else gt
    if low is not None and le is not None:
        return f"in {'[' if ge is not None else '('}{_bound_text(low)}, {_bound_text(le)}]"
    if low is not None:
        return f"{'>=' if ge is not None else '>'} {_bound_text(low)}"
    if le is not None:
        return f"<= {_bound_text(le)}"
    return ""


def _bound_text(bound: float) -> str:
    """A bound as a person writes it: ``1440`` for ``1440.0``, ``1e-07``, every digit of a large integer."""
    if isinstance(bound, int) or (bound.is_integer() and abs(bound) < 1e16):
        return str(int(bound))
    return f"{bound:g}"


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
