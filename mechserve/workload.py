"""Workloads for the spec engines: parse, validate, and build a rung's Engine.

A workload is an engine section plus a request list, given either as a JSON
spec (MECHANISMS 4.2) or as ``--request ID:PROMPT_LEN:MAX_NEW[:ARRIVAL[:EOS_AFTER]]``
flags.  Everything is validated up front (departure D4), and every problem
raises one ``WorkloadError`` whose message names the offending field::

    requests[2].max_new_tokens: must be an integer > 0, got "x"

The validated ``Workload`` is rung-independent; ``build_engine`` turns it into
the ``Engine`` of any rung of the ladder, passing only what that rung takes.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mechserve.spec import RUNGS

ENGINE_DEFAULTS: Mapping[str, int] = {
    "max_step_tokens": 8,
    "page_size": 4,
    "num_pages": 8,
    "spec_len": 0,
    "world_size": 1,
}
# spec_len may be 0; every other engine value is a size and must be > 0.
_ENGINE_MINIMUM = {"spec_len": 0}
TOP_KEYS = ("engine", "requests")
REQUEST_KEYS = (
    "request_id",
    "prompt_len",
    "tokens",
    "max_new_tokens",
    "arrival_step",
    "eos_after",
    "accept_script",
)
REQUEST_FLAG = "ID:PROMPT_LEN:MAX_NEW[:ARRIVAL[:EOS_AFTER]]"
_FLAG_FIELDS = ("ID", "PROMPT_LEN", "MAX_NEW", "ARRIVAL", "EOS_AFTER")
# The prompt of the request at list position i is [SYNTHETIC_STRIDE*i, ...].
SYNTHETIC_STRIDE = 1000


class WorkloadError(ValueError):
    """A workload (JSON spec, ``--request`` flag, engine value or rung choice) is invalid."""


class UnknownRung(WorkloadError):
    """A rung name that is not on the ladder."""


@dataclass(frozen=True)
class RequestSpec:
    """One validated request: the prompt is always explicit token ids."""

    request_id: str
    tokens: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    eos_after: int | None = None
    accept_script: tuple[int, ...] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Workload:
    """A validated workload: every engine value (defaults filled in) and the requests in list order."""

    engine: Mapping[str, int]
    requests: tuple[RequestSpec, ...]


def synthetic_prompt(index: int, prompt_len: int) -> tuple[int, ...]:
    """The prompt of the request at 0-based list position ``index``: ``[1000*index, ..., 1000*index + prompt_len - 1]``."""
    start = SYNTHETIC_STRIDE * index
    return tuple(range(start, start + prompt_len))


def _show(value: object) -> str:
    """A value as the user wrote it (JSON spelling), shortened when long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(where: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``; bools, floats and strings are rejected.

    Raises ``WorkloadError`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise WorkloadError(f"{where}: must be an integer {bound}, got {_show(value)}")
    return value


def _int_list(where: str, value: object, minimum: int | None) -> tuple[int, ...]:
    """``value`` as a tuple if it is a list of integers (each >= ``minimum`` when given).

    Raises ``WorkloadError`` otherwise.
    """
    bound = "" if minimum is None else f" >= {minimum}"
    if not isinstance(value, list):
        raise WorkloadError(f"{where}: must be a list of integers{bound}, got {_show(value)}")
    for i, item in enumerate(value):
        if not _is_int(item) or (minimum is not None and item < minimum):
            raise WorkloadError(f"{where}[{i}]: must be an integer{bound}, got {_show(item)}")
    return tuple(value)


def _check_keys(where: str, obj: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raises ``WorkloadError`` naming the first key of ``obj`` not in ``known``."""
    known = tuple(known)
    for key in obj:
        if key not in known:
            raise WorkloadError(f"{where}: unknown key {_show(key)} (known keys: {', '.join(known)})")


def _object(where: str, value: object) -> dict[str, Any]:
    """``value`` if it is a JSON object; ``WorkloadError`` otherwise."""
    if not isinstance(value, dict):
        raise WorkloadError(f"{where}: must be a JSON object, got {_show(value)}")
    return value


def engine_value(name: str, value: object, where: str | None = None) -> int:
    """Validate one engine value: an integer, >= 0 for ``spec_len`` and > 0 for every size.

    Raises ``WorkloadError`` (naming ``where``, default ``engine.<name>``).
    """
    return _integer(where or f"engine.{name}", value, _ENGINE_MINIMUM.get(name, 1))


def parse_engine(section: object) -> dict[str, int]:
    """The engine section with defaults filled in; a missing or null section means ``{}``.

    Raises ``WorkloadError`` for a non-object, an unknown key or an invalid value.
    """
    if section is None:
        section = {}
    section = _object("engine", section)
    _check_keys("engine", section, ENGINE_DEFAULTS)
    engine = dict(ENGINE_DEFAULTS)
    for name, value in section.items():
        engine[name] = engine_value(name, value)
    return engine


def with_engine(
    workload: Workload, overrides: Mapping[str, object], labels: Mapping[str, str] | None = None
) -> Workload:
    """``workload`` with the given engine values replaced (flags override the spec, even when 0).

    ``labels`` names each value in errors (e.g. ``--num-pages``).  Raises
    ``WorkloadError`` for an unknown name or an invalid value.
    """
    engine = dict(workload.engine)
    for name, value in overrides.items():
        if name not in ENGINE_DEFAULTS:
            raise WorkloadError(f"unknown engine value {_show(name)}")
        engine[name] = engine_value(name, value, (labels or {}).get(name))
    return dataclasses.replace(workload, engine=engine)


def _request_id(where: str, value: object) -> str:
    """A request id: a non-empty string, or an integer passed through ``str()``."""
    if _is_int(value):
        return str(value)
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: must be a non-empty string, got {_show(value)}")
    return value


def _prompt(where: str, sep: str, raw: Mapping[str, Any], index: int) -> tuple[int, ...]:
    """The prompt tokens from ``tokens`` and/or ``prompt_len`` (null means absent).

    Raises ``WorkloadError`` for a missing prompt, an invalid value, or a
    ``prompt_len`` that disagrees with the ``tokens`` given.
    """
    tokens, raw_len = raw.get("tokens"), raw.get("prompt_len")
    prompt_len = None if raw_len is None else _integer(f"{where}{sep}prompt_len", raw_len, 1)
    if tokens is None:
        if prompt_len is None:
            raise WorkloadError(f"{where}: missing prompt: give prompt_len or tokens")
        return synthetic_prompt(index, prompt_len)
    ids = _int_list(f"{where}{sep}tokens", tokens, 0)
    if not ids:
        raise WorkloadError(f"{where}{sep}tokens: must not be empty")
    if prompt_len is not None and prompt_len != len(ids):
        raise WorkloadError(f"{where}: prompt_len {prompt_len} disagrees with the {len(ids)} tokens given")
    return ids


def _optional_int(where: str, value: object) -> int | None:
    return None if value is None else _integer(where, value, 0)


def parse_request(raw: object, index: int, where: str | None = None, sep: str = ".") -> RequestSpec:
    """Validate one request object at 0-based list position ``index``.

    Errors name the request as ``where`` (default ``requests[<index>]``) and a
    field as ``where + sep + name``.  A request without ``tokens`` gets the synthetic prompt of its position.
    ``arrival_step``, ``eos_after`` and ``accept_script`` may be null (absent).
    Raises ``WorkloadError`` for an unknown key, a missing ``request_id``,
    ``max_new_tokens`` or prompt, a non-integer value, a size <= 0, a negative
    ``arrival_step`` or ``eos_after``, or an ``accept_script`` that is not a
    list of integers.
    """
    where = where or f"requests[{index}]"
    req = _object(where, raw)
    _check_keys(where, req, REQUEST_KEYS)
    for required in ("request_id", "max_new_tokens"):
        if required not in req:
            raise WorkloadError(f"{where}: missing {required}")
    script = req.get("accept_script")
    return RequestSpec(
        request_id=_request_id(f"{where}{sep}request_id", req["request_id"]),
        tokens=_prompt(where, sep, req, index),
        max_new_tokens=_integer(f"{where}{sep}max_new_tokens", req["max_new_tokens"], 1),
        arrival_step=_optional_int(f"{where}{sep}arrival_step", req.get("arrival_step")) or 0,
        eos_after=_optional_int(f"{where}{sep}eos_after", req.get("eos_after")),
        accept_script=None if script is None else _int_list(f"{where}{sep}accept_script", script, None),
    )


def _check_unique(requests: Sequence[RequestSpec], labels: Sequence[str]) -> None:
    """Raises ``WorkloadError`` at the second use of a request id; ``labels`` name the requests."""
    first: dict[str, str] = {}
    for req, label in zip(requests, labels):
        if req.request_id in first:
            raise WorkloadError(
                f"{label}: duplicate request_id {_show(req.request_id)} (already used by {first[req.request_id]})"
            )
        first[req.request_id] = label


def parse_requests(section: object) -> tuple[RequestSpec, ...]:
    """The request list; a missing or null list means no requests.

    Raises ``WorkloadError`` for a non-list, an invalid request or a duplicate id.
    """
    if section is None:
        return ()
    if not isinstance(section, list):
        raise WorkloadError(f"requests: must be a list, got {_show(section)}")
    requests = tuple(parse_request(raw, i) for i, raw in enumerate(section))
    _check_unique(requests, [f"requests[{i}]" for i in range(len(requests))])
    return requests


def parse_workload(data: object) -> Workload:
    """Validate a decoded JSON workload spec (MECHANISMS 4.2).

    Raises ``WorkloadError`` if the top level is not an object, has an
    unknown key, or any engine value or request is invalid.
    """
    if not isinstance(data, dict):
        raise WorkloadError(f"the workload must be a JSON object at the top level, got {_show(data)}")
    _check_keys("workload", data, TOP_KEYS)
    return Workload(parse_engine(data.get("engine")), parse_requests(data.get("requests")))


class _RepeatedKey(ValueError):
    pass


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object from its pairs; raises ``_RepeatedKey`` if a key appears twice (JSON would keep the last)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _RepeatedKey(f"key {_show(key)} appears twice in one object")
        obj[key] = value
    return obj


def load_workload(text: str, source: str = "workload") -> Workload:
    """Parse and validate a JSON workload spec given as text.

    Raises ``WorkloadError`` for malformed JSON (naming ``source`` and the
    position), a key repeated within one object, or any problem
    ``parse_workload`` reports.
    """
    try:
        data = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{source}: malformed JSON: {exc}") from None
    except _RepeatedKey as exc:
        raise WorkloadError(f"{source}: {exc}") from None
    return parse_workload(data)


def parse_request_flag(text: str, index: int) -> RequestSpec:
    """One ``--request ID:PROMPT_LEN:MAX_NEW[:ARRIVAL[:EOS_AFTER]]`` flag at position ``index``.

    The numeric fields go through ``int()``; the prompt is synthetic.  Raises
    ``WorkloadError`` for fewer than 3 or more than 5 fields, a field that is
    not an integer, or a value the JSON path would also reject.
    """
    where = f"--request {_show(text)}"
    parts = text.split(":")
    if not 3 <= len(parts) <= 5:
        raise WorkloadError(f"{where}: expected {REQUEST_FLAG} (3 to 5 fields), got {len(parts)} field(s)")
    values: list[object] = [parts[0]]
    for name, part in zip(_FLAG_FIELDS[1:], parts[1:]):
        try:
            values.append(int(part))
        except ValueError:
            raise WorkloadError(f"{where}: {name} must be an integer, got {_show(part)}") from None
    raw = dict(zip(("request_id", "prompt_len", "max_new_tokens", "arrival_step", "eos_after"), values))
    return parse_request(raw, index, where, sep=" ")


def workload_from_flags(flags: Sequence[str]) -> Workload:
    """A workload from ``--request`` flags, in flag order, with the default engine.

    Raises ``WorkloadError`` for an invalid flag or a duplicate id.
    """
    requests = tuple(parse_request_flag(text, i) for i, text in enumerate(flags))
    _check_unique(requests, [f"--request {_show(text)}" for text in flags])
    return Workload(dict(ENGINE_DEFAULTS), requests)


def rung_names() -> str:
    """The valid rung names, for messages."""
    return ", ".join(RUNGS)


def load_rung(name: str) -> ModuleType:
    """Import a rung by name: ``m05``, ``5``, ``05``, ``M05`` or ``m05_preemption``.

    Raises ``UnknownRung`` (a ``WorkloadError``) listing the valid names.
    """
    text = str(name).strip().lower()
    match = re.fullmatch(r"m?(\d{1,2})", text)
    if match and int(match.group(1)) < len(RUNGS):
        text = RUNGS[int(match.group(1))]
    if text not in RUNGS:
        raise UnknownRung(
            f"unknown rung {_show(str(name))}; valid rungs are m00 .. m{len(RUNGS) - 1:02d}: {rung_names()}"
        )
    return importlib.import_module(f"mechserve.spec.{text}")


def rung_label(rung: ModuleType) -> str:
    """The short name of a rung module, e.g. ``m05``."""
    return rung.__name__.rsplit(".", 1)[-1][:3]


def engine_params(rung: ModuleType) -> set[str]:
    """The parameter names of ``rung.Engine``'s constructor."""
    return set(inspect.signature(rung.Engine).parameters)


def _request_fields(rung: ModuleType) -> set[str]:
    return {f.name for f in dataclasses.fields(rung.Request)}


# engine value, its neutral value, the mechanism that uses it, the first rung that has it
_LATER_FEATURES = (("spec_len", 0, "speculative decoding", "m09"), ("world_size", 1, "parallelism", "m11"))


def check_rung(rung: ModuleType, workload: Workload) -> None:
    """Raise ``WorkloadError`` if ``workload`` uses something ``rung`` does not have.

    That is ``spec_len > 0`` or a non-empty ``accept_script`` before m09
    (speculative decoding), and ``world_size > 1`` before m11 (parallelism).
    An empty ``accept_script`` behaves like an absent one and is allowed.
    """
    label, params = rung_label(rung), engine_params(rung)
    for name, neutral, what, first in _LATER_FEATURES:
        if name not in params and workload.engine[name] != neutral:
            raise WorkloadError(
                f"{label} has no {what}: {name} {workload.engine[name]} needs {first} or later (or {name} {neutral})"
            )
    if "accept_script" not in _request_fields(rung):
        for req in workload.requests:
            if req.accept_script:
                raise WorkloadError(
                    f"{label} has no speculative decoding: request {_show(req.request_id)} has an accept_script "
                    "(it needs m09 or later)"
                )


def _make_request(rung: ModuleType, req: RequestSpec, fields: set[str]) -> Any:
    kwargs: dict[str, Any] = {
        "request_id": req.request_id,
        "max_new_tokens": req.max_new_tokens,
        "arrival_step": req.arrival_step,
        "eos_after": req.eos_after,
    }
    if "tokens" in fields:
        kwargs["tokens"] = list(req.tokens)
    else:
        kwargs["prompt_len"] = req.prompt_len
    if "accept_script" in fields and req.accept_script is not None:
        kwargs["accept_script"] = list(req.accept_script)  # the engine consumes it; give it its own list
    return rung.Request(**kwargs)


def build_engine(rung: ModuleType, workload: Workload) -> Any:
    """A fresh ``rung.Engine`` over fresh ``rung.Request`` objects for ``workload``.

    Only the engine values that rung's constructor takes are passed: m00 and
    m01 take none, m02 the budget, m03+ the page pool, m09+ ``spec_len`` and
    m11 ``world_size``.  Rungs before m08 know prompts only by length, so
    explicit ``tokens`` are reduced to their length there (the token ids
    themselves matter only to the prefix cache, which arrives in m08).
    Raises ``WorkloadError`` if the workload needs a feature the rung lacks
    (see ``check_rung``); the engine's own ``ValueError`` propagates.
    """
    check_rung(rung, workload)
    params, fields = engine_params(rung), _request_fields(rung)
    requests = [_make_request(rung, req, fields) for req in workload.requests]
    kwargs = {name: value for name, value in workload.engine.items() if name in params}
    return rung.Engine(requests, **kwargs)


def fit_rung(rung: ModuleType, workload: Workload) -> tuple[Workload, tuple[str, ...]]:
    """``workload`` without what ``rung`` lacks, and one note per mechanism left out.

    Before m09 ``spec_len`` becomes 0 and accept scripts are dropped; before
    m11 ``world_size`` becomes 1.  ``mechserve demo --mech`` uses this so the
    fixed demo runs on every rung; ``run`` reports the same things as errors
    (``check_rung``).
    """
    label, params = rung_label(rung), engine_params(rung)
    engine, requests, notes = dict(workload.engine), workload.requests, []
    scripted = "accept_script" not in _request_fields(rung) and any(r.accept_script for r in requests)
    if ("spec_len" not in params and engine["spec_len"] != 0) or scripted:
        notes.append(f"{label} has no speculative decoding: running with spec_len 0 and no accept scripts")
        engine["spec_len"] = 0
        requests = tuple(dataclasses.replace(r, accept_script=None) for r in requests)
    if "world_size" not in params and engine["world_size"] != 1:
        notes.append(f"{label} has no parallelism: running with world_size 1")
        engine["world_size"] = 1
    return Workload(engine, requests), tuple(notes)
