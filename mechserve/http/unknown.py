"""Request keys that no model of the server declares: refused with a 400 naming them, or ignored on the operator's word.

A key of a body is *known* when the endpoint's field table (``mechserve.http.fields``) has a row for it
(honoured or refused) or, inside the body, when the model of that part declares it (a chat message's
``role``/``content``/..., a tool's ``type``/``function``, ``stream_options.include_usage``, ...).  Every
other key is *unknown*: most often a typo (``max_token``, ``temprature``, ``messages.0.contnet``), which a
server that ignored it would answer as if the field had never been sent (OpenAI's own API refuses such a
key, "Unrecognized request argument supplied", and Anthropic's, "Extra inputs are not permitted"; vLLM
ignores it and logs it).  The request models report
their unknown keys (``mechserve.http.protocol._Body.unknown_fields``, as ``Unknown`` s with dotted paths);
``judge`` decides::

    default                       400 unsupported_parameter, param the first unknown key's path, message
                                  "unknown field 'max_token' (did you mean 'max_tokens'?)" (the closest
                                  known name beside it, by difflib, when one is close)
    --ignore-unknown-fields       accepted and ignored: each key's pattern (``messages.*.id``) is logged
                                  once per server process at WARNING, and the patterns of this request are
                                  echoed in the response header ``x-mechserve-ignored-fields``

The flag exists for proxies and gateways (LiteLLM, API gateways) that add their own keys to bodies;
vLLM and SGLang have no switch either way.  The log keeps
at most ``MAX_LOGGED`` patterns (a body of a million invented keys cannot grow it), and the header names at
most ``MAX_HEADER_PATTERNS`` of a request's, escaped to printable ASCII.
"""

from __future__ import annotations

import difflib
import logging
import re
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.http.errors import APIError

log = logging.getLogger("mechserve.http")
IGNORED_HEADER = "x-mechserve-ignored-fields"
IGNORE_FLAG = "--ignore-unknown-fields"
MAX_LOGGED = 1024  # patterns logged per server; past that, one last line says logging stopped
MAX_HEADER_PATTERNS = 32
SCOPE_KEY = "mechserve.ignored_fields"  # the ASGI scope's list of a request's ignored patterns
_INDEX = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$)")


@dataclass(frozen=True, slots=True)
class Unknown:
    """One unknown key: its dotted ``path`` in the body (``max_token``, ``messages.0.contnet``) and the
    ``known`` names beside it (what a close match is looked for among)."""

    path: str
    known: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The key itself, the path's last part."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def pattern(self) -> str:
        """The path with list indices as ``*`` (``messages.*.id``): what the log and the header name."""
        return _INDEX.sub("*", self.path)

    def suggestion(self) -> str | None:
        """The path of the closest known name beside it (``difflib.get_close_matches``, cutoff 0.6), or None."""
        close = difflib.get_close_matches(self.name, self.known, n=1)
        if not close:
            return None
        return self.path[: len(self.path) - len(self.name)] + close[0]

    def message(self) -> str:
        """``unknown field 'max_token' (did you mean 'max_tokens'?)``."""
        close = self.suggestion()
        return f"unknown field {self.path!r}" + (f" (did you mean {close!r}?)" if close else "")


def keys_outside(value: object, known: Collection[str], where: str) -> list[Unknown]:
    """The keys of ``value`` (when it is an object) that are not in ``known``, as ``Unknown`` s under ``where``
    (a dotted prefix ending in ``.``, or ``""`` at the top)."""
    if not isinstance(value, Mapping):
        return []
    outside = [key for key in value if isinstance(key, str) and key not in known]
    names = tuple(sorted(known)) if outside else ()
    return [Unknown(f"{where}{key}", names) for key in outside]


def each(values: object) -> Iterable[tuple[int, object]]:
    """``enumerate(values)`` when it is a JSON array, else nothing (a wrong type is the models' error to report)."""
    return enumerate(values) if isinstance(values, list) else ()


class UnknownField(ValueError):
    """A body with keys no model declares (``unknown``, in the body's order; the first is ``param``)."""

    def __init__(self, unknown: Sequence[Unknown]) -> None:
        first, rest = unknown[0], unknown[1:]
        more = f"; also unknown: {', '.join(repr(u.path) for u in rest[:8])}" if rest else ""
        more += f" and {len(rest) - 8} more" if len(rest) > 8 else ""
        super().__init__(first.message() + more)
        self.param = first.path
        self.unknown = tuple(unknown)


class UnknownPolicy:
    """What the server does with unknown keys: refuse them (the default) or ignore them (``ignore``, the
    operator's ``--ignore-unknown-fields``), logging each pattern once per policy (per server)."""

    def __init__(self, ignore: bool = False) -> None:
        self.ignore = ignore
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def judge(self, unknown: Sequence[Unknown], endpoint: str) -> list[str]:
        """The patterns ignored (``[]`` for a body with none).  Raises ``UnknownField`` unless ``ignore``."""
        if not unknown:
            return []
        if not self.ignore:
            raise UnknownField(unknown)
        patterns = list(dict.fromkeys(u.pattern for u in unknown))
        with self._lock:
            room = MAX_LOGGED - len(self._logged)
            new = [p for p in patterns if (endpoint, p) not in self._logged][: max(room, 0)]
            self._logged.update((endpoint, p) for p in new)
            full = room > 0 and len(self._logged) >= MAX_LOGGED
        for pattern in new:
            log.warning("ignoring the unknown field %r of %s bodies (%s); logged once", pattern, endpoint, IGNORE_FLAG)
        if full:
            log.warning("%d unknown fields were logged; further ones are ignored without a log line", MAX_LOGGED)
        return patterns


def judge_unknown(request: Any, body: Any, endpoint: str) -> None:
    """Judge ``body``'s unknown keys (``body.unknown_fields()``) by the app's ``UnknownPolicy``
    (``request.app.state.unknown_fields``): a 400 ``unsupported_parameter`` naming the first, or, when they
    are ignored, their patterns noted in the request's scope for ``IgnoredFieldsHeader``."""
    policy: UnknownPolicy = request.app.state.unknown_fields
    try:
        ignored = policy.judge(body.unknown_fields(), endpoint)
    except UnknownField as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    noted = request.scope.get(SCOPE_KEY)
    if ignored and isinstance(noted, list):
        noted.extend(ignored)


class IgnoredFieldsHeader:
    """ASGI middleware: a response to a request whose unknown keys were ignored carries ``IGNORED_HEADER``,
    their patterns comma-separated (at most ``MAX_HEADER_PATTERNS``, escaped to printable ASCII)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ignored: list[str] = []
        scope[SCOPE_KEY] = ignored

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start" and ignored:
                header = (IGNORED_HEADER.encode(), _value(ignored))
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, sending)


def _value(patterns: Sequence[str]) -> bytes:
    shown = list(dict.fromkeys(patterns))
    more = len(shown) - MAX_HEADER_PATTERNS
    text = ", ".join(shown[:MAX_HEADER_PATTERNS]) + (f", ... {more} more" if more > 0 else "")
    return text.encode("unicode_escape")


__all__ = [
    "IGNORED_HEADER",
    "IGNORE_FLAG",
    "IgnoredFieldsHeader",
    "Unknown",
    "UnknownField",
    "UnknownPolicy",
    "each",
    "judge_unknown",
    "keys_outside",
]
