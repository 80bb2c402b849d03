"""Workloads for the spec engines: parse, validate, and build a rung's Engine.

A workload is an engine section plus a request list, given either as a JSON
spec (MECHANISMS 4.2) or as ``--request ID:PROMPT_LEN:MAX_NEW[:ARRIVAL[:EOS_AFTER]]``
flags.  Everything is validated up front (departure D4), and every problem
raises one ``WorkloadError`` whose message names the offending field::

    requests[2].max_new_tokens: must be an integer >= 0, got "x"

Every size has an upper limit (``mechserve.api.limits``) so that no value,
however large, makes the engine allocate without bound or step for ever
before it says anything.

The validated ``Workload`` is rung-independent; ``build_engine`` turns it into
the ``Engine`` of any rung of the ladder, passing only what that rung takes,
and ``check_rung`` reports what a lower rung cannot take (prefix caching
before m08, speculation before m09, ranks before m11, admission settings and
the shared-prefix hold before m12, output caching before m13, forced scripts
before m14, a fleet before m15, draft limit scripts before m16).  ``build_fleet`` turns it into m15's
``Fleet``: the ``fleet`` section (``replicas``, ``routing_policy`` and the
router's thresholds) beside the engine section every replica gets.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import json
import re
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mechserve.api.config import setting_range
from mechserve.api.limits import (
    MAX_ARRIVAL_STEP,
    MAX_NEW_TOKENS,
    MAX_PROMPT_LEN,
    MAX_REPLICAS,
    MAX_SLOTS,
    MAX_TOTAL_PROMPT_TOKENS,
    TOKEN_ID_LIMIT,
)
from mechserve.spec import RUNGS
from mechserve.spec.m15_routing import POLICIES as ROUTING_POLICIES

ENGINE_DEFAULTS: Mapping[str, int] = {
    "max_step_tokens": 8,
    "page_size": 4,
    "num_pages": 8,
    "spec_len": 0,
    "world_size": 1,
}
# m12's admission settings: absent (no limit) unless given.
ENGINE_OPTIONAL = ("max_waiting", "max_running", "max_model_len")
ENGINE_KEYS = (*ENGINE_DEFAULTS, *ENGINE_OPTIONAL)
# The engine switches, JSON booleans, absent (the rung's default) unless given: m08's prefix cache
# (default on), m12's shared-prefix hold (default off), m13's output caching (default off).
ENGINE_SWITCHES = ("prefix_caching", "hold_shared_prefix", "output_caching")
# Switches that act only with prefix caching on: given true beside prefix_caching false they are refused.
_NEEDS_PREFIX_CACHING = ("hold_shared_prefix", "output_caching")
# m15's fleet: how many replicas, the routing policy and its thresholds; absent unless given.
FLEET_KEYS = ("replicas", "routing_policy", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
MAX_BALANCE = 1_000_000
TOP_KEYS = ("engine", "fleet", "requests")
REQUEST_KEYS = (
    "request_id",
    "prompt_len",
    "tokens",
    "max_new_tokens",
    "arrival_step",
    "eos_after",
    "accept_script",
    "stop_token_ids",
    "forced_script",
    "draft_limit_script",
)
# m14: the most forced ids one forced_script may hold, over all its entries.
MAX_FORCED_IDS = 100_000
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
    """One validated request: the prompt is always explicit token ids (empty only for m12's door)."""

    request_id: str
    tokens: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    eos_after: int | None = None
    accept_script: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()  # m12
    # m14: (output index, forced ids) pairs, ascending index; None when absent
    forced_script: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    # m16: one draft limit per draft decision, front first; None when absent
    draft_limit_script: tuple[int, ...] | None = None
    synthetic: bool = False  # the prompt came from prompt_len (synthetic_prompt), not from explicit tokens

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Workload:
    """A validated workload: every engine value (defaults filled in, optional ones only when given),
    the requests in list order, and (m15) the fleet values given (none: one engine)."""

    engine: Mapping[str, int]
    requests: tuple[RequestSpec, ...]
    fleet: Mapping[str, Any] = field(default_factory=dict)


def synthetic_prompt(index: int, prompt_len: int) -> tuple[int, ...]:
    """The prompt of the request at 0-based list position ``index``: ``[1000*index, ..., 1000*index + prompt_len - 1]``."""
    start = SYNTHETIC_STRIDE * index
    return tuple(range(start, start + prompt_len))


def _show(value: object) -> str:
    """A value as the user wrote it (JSON spelling), shortened when long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bound(minimum: int) -> str:
    return "> 0" if minimum == 1 else f">= {minimum}"


def _integer(where: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]``; bools, floats and strings are rejected.

    Raises ``WorkloadError`` otherwise; above ``maximum`` the message names the limit.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{where}: must be an integer {_bound(minimum)}, got {_show(value)}")
    if maximum is not None and value > maximum:
        raise WorkloadError(f"{where}: must be at most {maximum} (mechserve's limit), got {_show(value)}")
    return value


def _int_list(where: str, value: object, minimum: int | None, below: int | None = None) -> tuple[int, ...]:
    """``value`` as a tuple if it is a list of integers (each >= ``minimum`` and < ``below`` when given).

    Raises ``WorkloadError`` otherwise.
    """
    if minimum is None:
        bound = ""
    elif below is None:
        bound = f" >= {minimum}"
    else:
        bound = f" from {minimum} to {below - 1}"
    if not isinstance(value, list):
        raise WorkloadError(f"{where}: must be a list of integers{bound}, got {_show(value)}")
    for i, item in enumerate(value):
        ok = _is_int(item) and (minimum is None or item >= minimum) and (below is None or item < below)
        if not ok:
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
    """Validate one engine value: an integer, >= 0 for ``spec_len`` and > 0 for every size, at most its limit.

    Raises ``WorkloadError`` (naming ``where``, default ``engine.<name>``).
    """
    least, most = setting_range(name)  # the range EngineConfig checks (api/config.py), in the workload's words
    return _integer(where or f"engine.{name}", value, least, most)


def switch_value(name: str, value: object, where: str | None = None) -> bool:
    """Validate one engine switch (``ENGINE_SWITCHES``): ``true`` or ``false``, nothing else.

    Raises ``WorkloadError`` (naming ``where``, default ``engine.<name>``).
    """
    if not isinstance(value, bool):
        raise WorkloadError(f"{where or f'engine.{name}'}: must be true or false, got {_show(value)}")
    return value


def _check_switches(engine: Mapping[str, int], labels: Mapping[str, str]) -> None:
    """Raises ``WorkloadError`` if a switch that acts only with prefix caching is true while
    ``prefix_caching`` is false (it would be accepted and do nothing)."""
    if engine.get("prefix_caching", True):
        return
    for name in _NEEDS_PREFIX_CACHING:
        if engine.get(name):
            raise WorkloadError(
                f"{labels[name]}: true needs prefix caching, but {labels['prefix_caching']} is false "
                f"(set {labels[name]} false or turn prefix caching on)"
            )


def _check_slots(engine: Mapping[str, int], labels: Mapping[str, str]) -> None:
    """Raises ``WorkloadError`` if the pool's ``num_pages x page_size`` slots exceed ``MAX_SLOTS``."""
    pages, size = engine["num_pages"], engine["page_size"]
    if pages * size > MAX_SLOTS:
        raise WorkloadError(
            f"{labels['num_pages']} {pages} x {labels['page_size']} {size} = {pages * size} slots, "
            f"over mechserve's limit of {MAX_SLOTS} slots; lower one of them"
        )


def parse_engine(section: object) -> dict[str, int]:
    """The engine section with defaults filled in; a missing or null section means ``{}``.

    The optional admission settings (``ENGINE_OPTIONAL``) and switches
    (``ENGINE_SWITCHES``, JSON booleans) appear only when given and not null.
    Raises ``WorkloadError`` for a non-object, an unknown key, an invalid
    value, a pool over ``MAX_SLOTS`` slots, or ``hold_shared_prefix`` or
    ``output_caching`` true with ``prefix_caching`` false.
    """
    if section is None:
        section = {}
    section = _object("engine", section)
    _check_keys("engine", section, (*ENGINE_KEYS, *ENGINE_SWITCHES))
    engine = dict(ENGINE_DEFAULTS)
    for name, value in section.items():
        if name in (*ENGINE_OPTIONAL, *ENGINE_SWITCHES) and value is None:
            continue
        engine[name] = switch_value(name, value) if name in ENGINE_SWITCHES else engine_value(name, value)
    labels = {name: f"engine.{name}" for name in (*ENGINE_KEYS, *ENGINE_SWITCHES)}
    _check_slots(engine, labels)
    _check_switches(engine, labels)
    return engine


# m15: the fleet section.
def fleet_value(name: str, value: object, where: str | None = None) -> Any:
    """Validate one fleet value: ``replicas`` an integer in 1..MAX_REPLICAS, ``routing_policy`` one of
    ``ROUTING_POLICIES``, ``cache_threshold`` a number in [0, 1], ``balance_abs_threshold`` an
    integer >= 0 and ``balance_rel_threshold`` a number >= 0 (both at most ``MAX_BALANCE``).

    Raises ``WorkloadError`` (naming ``where``, default ``fleet.<name>``).
    """
    where = where or f"fleet.{name}"
    if name == "replicas":
        return _integer(where, value, 1, MAX_REPLICAS)
    if name == "balance_abs_threshold":
        return _integer(where, value, 0, MAX_BALANCE)
    if name == "routing_policy":
        if value not in ROUTING_POLICIES:
            raise WorkloadError(f"{where}: must be one of {', '.join(ROUTING_POLICIES)}, got {_show(value)}")
        return value
    high = 1.0 if name == "cache_threshold" else float(MAX_BALANCE)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= high:
        raise WorkloadError(f"{where}: must be a number from 0 to {high:g}, got {_show(value)}")
    return float(value)


def parse_fleet(section: object) -> dict[str, Any]:
    """The fleet section's given values (null means absent); a missing or null section means ``{}``.

    Raises ``WorkloadError`` for a non-object, an unknown key or an invalid value.
    """
    if section is None:
        return {}
    section = _object("fleet", section)
    _check_keys("fleet", section, FLEET_KEYS)
    return {name: fleet_value(name, value) for name, value in section.items() if value is not None}


def with_fleet(
    workload: Workload, overrides: Mapping[str, object], labels: Mapping[str, str] | None = None
) -> Workload:
    """``workload`` with the given fleet values replaced (flags override the spec); ``labels`` name
    them in errors (e.g. ``--replicas``).  Raises ``WorkloadError`` for an unknown name or a bad value."""
    fleet = dict(workload.fleet)
    for name, value in overrides.items():
        if name not in FLEET_KEYS:
            raise WorkloadError(f"unknown fleet value {_show(name)}")
        fleet[name] = fleet_value(name, value, (labels or {}).get(name))
    return dataclasses.replace(workload, fleet=fleet)


def with_engine(
    workload: Workload, overrides: Mapping[str, object], labels: Mapping[str, str] | None = None
) -> Workload:
    """``workload`` with the given engine values replaced (flags override the spec, even when 0).

    ``labels`` names each value in errors (e.g. ``--num-pages``).  Raises
    ``WorkloadError`` for an unknown name, an invalid value, a pool over
    ``MAX_SLOTS`` slots, or a switch that needs prefix caching turned on
    while it is off.
    """
    engine = dict(workload.engine)
    names = {name: f"engine.{name}" for name in (*ENGINE_KEYS, *ENGINE_SWITCHES)}
    for name, value in overrides.items():
        if name not in names:
            raise WorkloadError(f"unknown engine value {_show(name)}")
        names[name] = (labels or {}).get(name, names[name])
        check = switch_value if name in ENGINE_SWITCHES else engine_value
        engine[name] = check(name, value, names[name])
    _check_slots(engine, names)
    _check_switches(engine, names)
    return dataclasses.replace(workload, engine=engine)


# Characters that would break a trace line or a terminal: C0/C1 controls (newline, ESC, ...) and line separators.
_UNPRINTABLE = ("Cc", "Zl", "Zp")


def _request_id(where: str, value: object) -> str:
    """A request id: a non-empty string without control characters or surrounding whitespace,
    or an integer passed through ``str()``."""
    if _is_int(value):
        return str(value)
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: must be a non-empty string, got {_show(value)}")
    if any(unicodedata.category(ch) in _UNPRINTABLE for ch in value):
        raise WorkloadError(
            f"{where}: must not contain control characters (newline, tab, ESC, ...), got {_show(value)}"
        )
    if value != value.strip():
        raise WorkloadError(f"{where}: must not begin or end with whitespace, got {_show(value)}")
    return value


def _prompt(where: str, sep: str, raw: Mapping[str, Any], index: int, room: int) -> tuple[int, ...]:
    """The prompt tokens from ``tokens`` and/or ``prompt_len`` (null means absent).

    ``room`` is how many prompt tokens the workload may still hold.  An empty
    ``tokens`` list is valid here (m12's door rejects it; ``check_rung``
    refuses it below m12).  Raises ``WorkloadError`` for a missing prompt, an
    invalid value, a prompt over ``MAX_PROMPT_LEN`` or ``room``, or a
    ``prompt_len`` that disagrees with the ``tokens`` given.
    """
    tokens, raw_len = raw.get("tokens"), raw.get("prompt_len")
    prompt_len = None if raw_len is None else _integer(f"{where}{sep}prompt_len", raw_len, 1, MAX_PROMPT_LEN)
    if tokens is None:
        if prompt_len is None:
            raise WorkloadError(f"{where}: missing prompt: give prompt_len or tokens")
        ids = None
        length = prompt_len
    else:
        ids = _int_list(f"{where}{sep}tokens", tokens, 0, TOKEN_ID_LIMIT)
        if len(ids) > MAX_PROMPT_LEN:
            raise WorkloadError(f"{where}{sep}tokens: {len(ids)} tokens, over mechserve's limit of {MAX_PROMPT_LEN}")
        if prompt_len is not None and prompt_len != len(ids):
            raise WorkloadError(f"{where}: prompt_len {prompt_len} disagrees with the {len(ids)} tokens given")
        length = len(ids)
    if length > room:
        raise WorkloadError(
            f"{where}: the workload's prompts would total more than {MAX_TOTAL_PROMPT_TOKENS} tokens (mechserve's limit)"
        )
    return synthetic_prompt(index, length) if ids is None else ids


def _forced_script(where: str, value: object) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """m14's scripted grammar: a JSON object from an output index (a decimal string) to a non-empty
    list of token ids, as ``(index, ids)`` pairs in ascending index.

    Raises ``WorkloadError`` for a non-object, a key that is not a decimal integer >= 0, a value that
    is not a non-empty list of token ids, or more than ``MAX_FORCED_IDS`` ids in all.
    """
    script = _object(where, value)
    pairs: list[tuple[int, tuple[int, ...]]] = []
    total = 0
    for key, ids in script.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise WorkloadError(f"{where}: key {_show(key)} must be an output index (a decimal integer >= 0)")
        forced = _int_list(f"{where}.{key}", ids, 0, TOKEN_ID_LIMIT)
        if not forced:
            raise WorkloadError(f"{where}.{key}: must be a non-empty list of token ids, got []")
        total += len(forced)
        if total > MAX_FORCED_IDS:
            raise WorkloadError(f"{where}: more than {MAX_FORCED_IDS} forced ids (mechserve's limit)")
        pairs.append((int(key), forced))
    pairs.sort()
    for (a, _), (b, _) in itertools.pairwise(pairs):  # "1" and "01" name one index
        if a == b:
            raise WorkloadError(f"{where}: output index {a} appears twice")
    return tuple(pairs)


def _optional_int(where: str, value: object, maximum: int | None = None) -> int | None:
    return None if value is None else _integer(where, value, 0, maximum)


def parse_request(
    raw: object, index: int, where: str | None = None, sep: str = ".", room: int = MAX_TOTAL_PROMPT_TOKENS
) -> RequestSpec:
    """Validate one request object at 0-based list position ``index``.

    Errors name the request as ``where`` (default ``requests[<index>]``) and a
    field as ``where + sep + name``.  A request without ``tokens`` gets the
    synthetic prompt of its position.  ``arrival_step``, ``eos_after``,
    ``accept_script``, ``stop_token_ids``, ``forced_script`` (m14) and ``draft_limit_script`` (m16)
    may be null (absent).
    ``max_new_tokens`` may be 0 and ``tokens`` empty here (m12 takes both;
    ``check_rung`` refuses them below m12).  Raises ``WorkloadError`` for an
    unknown key, a missing ``request_id``, ``max_new_tokens`` or prompt, a
    non-integer value, a ``prompt_len`` <= 0, a negative value, a value over
    its limit, a bad request id (control characters, surrounding
    whitespace), or a script or stop list that is not a list of integers.
    """
    where = where or f"requests[{index}]"
    req = _object(where, raw)
    _check_keys(where, req, REQUEST_KEYS)
    for required in ("request_id", "max_new_tokens"):
        if required not in req:
            raise WorkloadError(f"{where}: missing {required}")
    script, stops, forced = req.get("accept_script"), req.get("stop_token_ids"), req.get("forced_script")
    limits = req.get("draft_limit_script")  # m16
    max_new = _integer(f"{where}{sep}max_new_tokens", req["max_new_tokens"], 0, MAX_NEW_TOKENS)
    forced_script = None if forced is None else _forced_script(f"{where}{sep}forced_script", forced)
    for index, _ in forced_script or ():
        if index >= max_new:  # m14: output index i exists only below max_new_tokens
            raise WorkloadError(
                f"{where}{sep}forced_script: output index {index} is never reached "
                f"(max_new_tokens is {max_new}, so indices run 0..{max_new - 1})"
            )
    return RequestSpec(
        request_id=_request_id(f"{where}{sep}request_id", req["request_id"]),
        tokens=_prompt(where, sep, req, index, room),
        max_new_tokens=_integer(f"{where}{sep}max_new_tokens", req["max_new_tokens"], 0, MAX_NEW_TOKENS),
        arrival_step=_optional_int(f"{where}{sep}arrival_step", req.get("arrival_step"), MAX_ARRIVAL_STEP) or 0,
        eos_after=_optional_int(f"{where}{sep}eos_after", req.get("eos_after")),
        accept_script=None if script is None else _int_list(f"{where}{sep}accept_script", script, None),
        stop_token_ids=() if stops is None else _int_list(f"{where}{sep}stop_token_ids", stops, 0, TOKEN_ID_LIMIT),
        forced_script=forced_script,
        draft_limit_script=None if limits is None else _int_list(f"{where}{sep}draft_limit_script", limits, 0),
        synthetic=req.get("tokens") is None,
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

    Raises ``WorkloadError`` for a non-list, an invalid request, prompts over
    ``MAX_TOTAL_PROMPT_TOKENS`` together, or a duplicate id.
    """
    if section is None:
        return ()
    if not isinstance(section, list):
        raise WorkloadError(f"requests: must be a list, got {_show(section)}")
    requests: list[RequestSpec] = []
    room = MAX_TOTAL_PROMPT_TOKENS
    for i, raw in enumerate(section):
        requests.append(parse_request(raw, i, room=room))
        room -= requests[-1].prompt_len
    _check_unique(requests, [f"requests[{i}]" for i in range(len(requests))])
    return tuple(requests)


def parse_workload(data: object) -> Workload:
    """Validate a decoded JSON workload spec (MECHANISMS 4.2).

    Raises ``WorkloadError`` if the top level is not an object, has an
    unknown key, or any engine value or request is invalid.
    """
    if not isinstance(data, dict):
        raise WorkloadError(f"the workload must be a JSON object at the top level, got {_show(data)}")
    _check_keys("workload", data, TOP_KEYS)
    engine = parse_engine(data.get("engine"))
    return Workload(engine, parse_requests(data.get("requests")), parse_fleet(data.get("fleet")))


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
    position), JSON Python cannot convert (an integer of more digits than
    ``sys.get_int_max_str_digits()``, nesting deeper than the recursion
    limit), a key repeated within one object, or any problem
    ``parse_workload`` reports.
    """
    try:
        data = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{source}: malformed JSON: {exc}") from None
    except _RepeatedKey as exc:
        raise WorkloadError(f"{source}: {exc}") from None
    except ValueError:  # int("9" * 5000): Python's integer-string limit
        raise WorkloadError(
            f"{source}: malformed JSON: a number has more than {sys.get_int_max_str_digits()} digits"
        ) from None
    except RecursionError:
        raise WorkloadError(f"{source}: malformed JSON: arrays or objects are nested too deeply") from None
    return parse_workload(data)


def parse_request_flag(text: str, index: int, room: int = MAX_TOTAL_PROMPT_TOKENS) -> RequestSpec:
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
    return parse_request(raw, index, where, sep=" ", room=room)


def workload_from_flags(flags: Sequence[str]) -> Workload:
    """A workload from ``--request`` flags, in flag order, with the default engine.

    Raises ``WorkloadError`` for an invalid flag or a duplicate id.
    """
    requests: list[RequestSpec] = []
    room = MAX_TOTAL_PROMPT_TOKENS
    for i, text in enumerate(flags):
        requests.append(parse_request_flag(text, i, room))
        room -= requests[-1].prompt_len
    _check_unique(requests, [f"--request {_show(text)}" for text in flags])
    return Workload(dict(ENGINE_DEFAULTS), tuple(requests))


def rung_names() -> str:
    """The valid rung names, for messages."""
    return ", ".join(RUNGS)


def rung_range() -> str:
    """The short names of the ladder's ends, e.g. ``m00 .. m12``."""
    return f"{RUNGS[0][:3]} .. {RUNGS[-1][:3]}"


def load_rung(name: str) -> ModuleType:
    """Import a rung by name: ``m05``, ``5``, ``05``, ``M05`` or ``m05_preemption``.

    Raises ``UnknownRung`` (a ``WorkloadError``) listing the valid names.
    """
    text = str(name).strip().lower()
    match = re.fullmatch(r"m?(\d{1,2})", text)
    if match and int(match.group(1)) < len(RUNGS):
        text = RUNGS[int(match.group(1))]
    if text not in RUNGS:
        raise UnknownRung(f"unknown rung {_show(str(name))}; valid rungs are {rung_range()}: {rung_names()}")
    return importlib.import_module(f"mechserve.spec.{text}")


def rung_label(rung: ModuleType) -> str:
    """The short name of a rung module, e.g. ``m05``."""
    return str(rung.__name__.rsplit(".", 1)[-1][:3])


def engine_params(rung: ModuleType) -> set[str]:
    """The parameter names of ``rung.Engine``'s constructor."""
    return set(inspect.signature(rung.Engine).parameters)


def _request_fields(rung: ModuleType) -> set[str]:
    return {f.name for f in dataclasses.fields(rung.Request)}


# engine value, its neutral value, the mechanism that uses it, the first rung that has it
_LATER_FEATURES = (("spec_len", 0, "speculative decoding", "m09"), ("world_size", 1, "parallelism", "m11"))
_ADMISSION = "admission control"
_ADMISSION_RUNG = "m12"
# engine switch, the mechanism that uses it, the first rung that has it (each is off below that rung)
_LATER_SWITCHES = (
    ("prefix_caching", "prefix caching", "m08"),
    ("hold_shared_prefix", "shared-prefix hold", "m12"),
    ("output_caching", "output caching", "m13"),
)


def has_routing(rung: ModuleType) -> bool:
    """Whether ``rung`` has m15's fleet and router."""
    return hasattr(rung, "Fleet")


def runs_fleet(rung: ModuleType, workload: Workload) -> bool:
    """Whether ``workload`` on ``rung`` is a fleet (``build_fleet``) rather than one engine.

    m15, whose mechanism is routing, always runs a fleet (one replica when the workload has no fleet
    section); a rung above it (m16: one engine that also carries m15's routing) runs a fleet only for
    a workload with a fleet section.
    """
    return has_routing(rung) and (bool(workload.fleet) or rung.__name__.rsplit(".", 1)[-1] == "m15_routing")


def has_admission_control(rung: ModuleType) -> bool:
    """Whether ``rung`` has m12's door (``add_request``, ``max_waiting``, ...)."""
    return "max_waiting" in engine_params(rung)


def check_rung(rung: ModuleType, workload: Workload) -> None:
    """Raise ``WorkloadError`` if ``workload`` uses something ``rung`` does not have.

    That is ``spec_len > 0`` or a non-empty ``accept_script`` before m09
    (speculative decoding), ``world_size > 1`` before m11 (parallelism), and
    before m12 (admission control) any of ``max_waiting``, ``max_running``,
    ``max_model_len``, a non-empty ``stop_token_ids``, ``max_new_tokens`` 0
    or an empty ``tokens`` list, ``prefix_caching`` true before m08,
    ``hold_shared_prefix`` true before m12, ``output_caching`` true before m13,
    a non-empty ``forced_script`` before m14 (forced runs), any fleet value
    before m15 (routing), and a non-empty ``draft_limit_script`` before m16
    (per-request draft lengths).  From m09 on a non-empty ``accept_script`` with
    ``spec_len`` 0 is refused too: with no guesses there is no verdict to
    script.  An empty ``accept_script``, ``stop_token_ids`` or
    ``forced_script``, and a switch set to false (what a rung without the
    mechanism does), behave like absent ones and are allowed.
    """
    label, params = rung_label(rung), engine_params(rung)
    for name, neutral, what, first in _LATER_FEATURES:
        if name not in params and workload.engine[name] != neutral:
            raise WorkloadError(
                f"{label} has no {what}: {name} {workload.engine[name]} needs {first} or later (or {name} {neutral})"
            )
    for name, what, first in _LATER_SWITCHES:
        if name not in params and workload.engine.get(name):
            raise WorkloadError(f"{label} has no {what}: {name} true needs {first} or later (or {name} false)")
    if "accept_script" not in _request_fields(rung):
        for req in workload.requests:
            if req.accept_script:
                raise WorkloadError(
                    f"{label} has no speculative decoding: request {_show(req.request_id)} has an accept_script "
                    "(it needs m09 or later)"
                )
    elif workload.engine["spec_len"] == 0:
        for req in workload.requests:
            if req.accept_script:
                raise WorkloadError(
                    f"{label}: request {_show(req.request_id)} has an accept_script but engine.spec_len is 0, "
                    "so no window drafts a guess to accept (set spec_len > 0 or remove accept_script)"
                )
    if not has_admission_control(rung):
        _check_no_admission(label, workload)
    for name, mechanism, first in (
        ("forced_script", "forced runs", "m14"),
        ("draft_limit_script", "per-request draft lengths", "m16"),
    ):
        if name not in _request_fields(rung):
            for req in workload.requests:
                if getattr(req, name):
                    raise WorkloadError(
                        f"{label} has no {mechanism}: request {_show(req.request_id)} has a {name} "
                        f"(it needs {first} or later)"
                    )
    if workload.fleet and not has_routing(rung):  # m15
        given = ", ".join(f"fleet.{k} {_show(v)}" for k, v in workload.fleet.items())
        raise WorkloadError(f"{label} has no routing: {given} need m15 or later (or drop the fleet section)")


def _check_no_admission(label: str, workload: Workload) -> None:
    """Raise ``WorkloadError`` for the first thing in ``workload`` that only m12's door takes."""
    why = f"{label} has no {_ADMISSION}:"
    later = f"needs {_ADMISSION_RUNG} or later"
    for name in ENGINE_OPTIONAL:
        if name in workload.engine:
            raise WorkloadError(f"{why} {name} {workload.engine[name]} {later}")
    for req in workload.requests:
        rid = _show(req.request_id)
        if req.max_new_tokens == 0:
            raise WorkloadError(f"{why} request {rid} has max_new_tokens 0 ({later}; {label} needs max_new_tokens > 0)")
        if not req.tokens:
            raise WorkloadError(f"{why} request {rid} has an empty prompt ({later}, which rejects it at the door)")
        if req.stop_token_ids:
            raise WorkloadError(f"{why} request {rid} has stop_token_ids ({later})")


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
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.forced_script and "forced_script" in fields:  # m14
        kwargs["forced_script"] = dict(req.forced_script)
    if req.draft_limit_script and "draft_limit_script" in fields:  # m16
        kwargs["draft_limit_script"] = list(req.draft_limit_script)
    return rung.Request(**kwargs)


def build_engine(rung: ModuleType, workload: Workload) -> Any:
    """A fresh ``rung.Engine`` over fresh ``rung.Request`` objects for ``workload``.

    Only the engine values that rung's constructor takes are passed: m00 and
    m01 take none, m02 the budget, m03+ the page pool, m09+ ``spec_len``,
    m11+ ``world_size``, m12+ the admission settings given, m08+ the
    ``prefix_caching`` switch given, m12+ the ``hold_shared_prefix`` switch
    given and m13+ the ``output_caching`` switch given.  Rungs before
    m08 know prompts only by length, so explicit ``tokens`` are reduced to
    their length there (the token ids themselves matter only to the prefix
    cache, which arrives in m08).  Raises ``WorkloadError`` if the workload
    needs a feature the rung lacks (see ``check_rung``); the engine's own
    ``ValueError`` propagates.
    """
    check_rung(rung, workload)
    if workload.fleet:  # m15: a fleet section describes a Fleet, not one engine
        raise WorkloadError(f"the fleet section ({', '.join(workload.fleet)}) builds a fleet: use build_fleet")
    params, fields = engine_params(rung), _request_fields(rung)
    requests = [_make_request(rung, req, fields) for req in workload.requests]
    kwargs = {name: value for name, value in workload.engine.items() if name in params}
    return rung.Engine(requests, **kwargs)


def build_fleet(rung: ModuleType, workload: Workload) -> Any:
    """m15: a fresh ``rung.Fleet`` for ``workload``: its fleet values (one replica and the rung's
    default policy unless given), every engine value given to each replica, the requests in list order.

    Raises ``WorkloadError`` for a rung without routing or a workload it cannot take; the fleet's
    own ``ValueError`` propagates.
    """
    if not has_routing(rung):
        raise WorkloadError(f"{rung_label(rung)} has no routing: a fleet needs m15 or later")
    check_rung(rung, workload)
    fields = _request_fields(rung)
    requests = [_make_request(rung, req, fields) for req in workload.requests]
    return rung.Fleet(requests, **workload.fleet, **workload.engine)


def fit_rung(rung: ModuleType, workload: Workload) -> tuple[Workload, tuple[str, ...]]:
    """``workload`` without what ``rung`` lacks, and one note per mechanism left out.

    Before m09 ``spec_len`` becomes 0 and accept scripts are dropped (from
    m09 on they are dropped too when ``spec_len`` is 0); before
    m11 ``world_size`` becomes 1; before m12 the admission settings and stop
    ids are dropped; the prefix-caching switch before m08, the shared-prefix
    hold before m12 and the output-caching switch before m13; before m14 the forced scripts are;
    before m15 the fleet section is; before m16 the draft limit scripts are.  ``mechserve demo --mech`` uses this so the fixed demo
    runs on every rung; ``run`` reports the same things as errors
    (``check_rung``).  Zero-token requests and empty prompts are not dropped:
    ``build_engine`` still refuses them below m12.
    """
    label, params = rung_label(rung), engine_params(rung)
    engine, requests, notes = dict(workload.engine), workload.requests, []
    scripted = "accept_script" not in _request_fields(rung) and any(r.accept_script for r in requests)
    if ("spec_len" not in params and engine["spec_len"] != 0) or scripted:
        notes.append(f"{label} has no speculative decoding: running with spec_len 0 and no accept scripts")
        engine["spec_len"] = 0
        requests = tuple(dataclasses.replace(r, accept_script=None) for r in requests)
    elif engine["spec_len"] == 0 and any(r.accept_script for r in requests):
        notes.append("spec_len is 0: running without accept scripts (no window drafts a guess to accept)")
        requests = tuple(dataclasses.replace(r, accept_script=None) for r in requests)
    if "world_size" not in params and engine["world_size"] != 1:
        notes.append(f"{label} has no parallelism: running with world_size 1")
        engine["world_size"] = 1
    dropped = [name for name in ENGINE_OPTIONAL if name in engine]
    dropped += ["stop_token_ids"] if any(r.stop_token_ids for r in requests) else []
    if "max_waiting" not in params and dropped:
        notes.append(f"{label} has no {_ADMISSION}: running without {', '.join(dropped)}")
        engine = {name: value for name, value in engine.items() if name not in ENGINE_OPTIONAL}
        requests = tuple(dataclasses.replace(r, stop_token_ids=()) for r in requests)
    for name, what, _ in _LATER_SWITCHES:
        if name not in params and name in engine and engine.pop(name):
            notes.append(f"{label} has no {what}: running without {name}")
    if "forced_script" not in _request_fields(rung) and any(r.forced_script for r in requests):  # m14
        notes.append(f"{label} has no forced runs: running without forced scripts")
        requests = tuple(dataclasses.replace(r, forced_script=None) for r in requests)
    if "draft_limit_script" not in _request_fields(rung) and any(r.draft_limit_script for r in requests):  # m16
        notes.append(f"{label} has no per-request draft lengths: running without draft limit scripts")
        requests = tuple(dataclasses.replace(r, draft_limit_script=None) for r in requests)
    fleet = workload.fleet
    if fleet and not has_routing(rung):  # m15
        notes.append(f"{label} has no routing: running one engine without {', '.join(f'fleet.{k}' for k in fleet)}")
        fleet = {}
    return Workload(engine, requests, fleet), tuple(notes)
