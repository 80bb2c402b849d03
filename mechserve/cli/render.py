"""How a run is printed: JSON lines (the fixed contract) or a readable rich view (D5).

Both views receive each step record as the engine produces it
(``Engine.run(on_step=view.step)``), so the steps before an engine error are
already printed when the error is reported; ``finish`` prints the summary.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.text import Text

# What an empty step means when no request is running (the usual case: a gap before an arrival).
IDLE = "nothing to do (waiting for arrivals)"


class View(Protocol):
    """Something that shows a run: a header, each step as it completes, then the summary.

    ``outputs`` (a real model's run only) are one object per request that
    produced text: ``request_id``, ``text``, ``token_ids``, ``finish_reason``, ...

    ``idle`` says why a step with no decisions did nothing.  ``flush`` prints
    anything held back (the text view collapses runs of idle steps); ``finish``
    flushes too.
    """

    def start(self, header: str, notes: Sequence[str]) -> None: ...

    def step(self, record: Any, idle: str = IDLE) -> None: ...

    def flush(self) -> None: ...

    def finish(
        self, summary: Sequence[Mapping[str, Any]], outputs: Sequence[Mapping[str, Any]] | None = None
    ) -> None: ...


class JsonView:
    """One ``json.dumps`` line per step (the record's ``to_json()``), then ``{"summary": [...]}``.

    With ``explain`` each step line ends with an ``"explain"`` key holding the
    engine's sentences.  The header and notes are not printed: stdout stays
    pure JSON lines.
    """

    def __init__(self, explain: bool = False, out: TextIO | None = None) -> None:
        self.explain = explain
        self.out = out or sys.stdout

    def start(self, header: str, notes: Sequence[str]) -> None:
        pass

    def step(self, record: Any, idle: str = IDLE) -> None:
        line = record.to_json()
        if self.explain:
            line["explain"] = list(record.explain)
        self._write(line)

    def flush(self) -> None:
        pass

    def finish(self, summary: Sequence[Mapping[str, Any]], outputs: Sequence[Mapping[str, Any]] | None = None) -> None:
        final: dict[str, Any] = {"summary": list(summary)}
        if outputs is not None:
            final["outputs"] = list(outputs)
        self._write(final)

    def _write(self, obj: Mapping[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


def format_value(value: Any) -> str:
    """A trace value as text: ``a, b`` for lists, ``a=6, b=TOKEN`` for maps, ``[1, 2]`` for id lists in maps."""
    if isinstance(value, Mapping):
        return ", ".join(f"{key}={_inner(item)}" for key, item in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value)
    return str(value)


def _inner(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(str(item) for item in value) + "]"
    return str(value)


class TextView:
    """The readable view: a header, then per step its non-empty fields by name, then a summary table.

    Values come from the record's ``to_json()``, so they read ``TOKEN``,
    ``EOS``, ``LENGTH``, never an enum repr; a rejection reads
    ``big=NEVER_FITS``.  Consecutive steps with nothing in them become one
    line (``steps 3–999: nothing to do (waiting for arrivals)``), so a long
    gap before an arrival costs one line (``--json`` still prints every step).
    With ``explain`` the engine's own sentences follow each step's fields.
    Long values wrap under themselves; no line ends in spaces.
    """

    columns: Sequence[tuple[str, str, str]] = ()  # the summary table's columns (SUMMARY_COLUMNS when empty)

    def __init__(self, explain: bool = False, console: Console | None = None) -> None:
        self.explain = explain
        self.columns = self.columns or SUMMARY_COLUMNS
        self.console = console or Console(file=sys.stdout, highlight=False)
        self._idle: tuple[int, int, str] | None = None  # first step, last step, why: held back until it ends
        self._reasons: dict[str, list[str]] = {}  # request id -> rejection reasons, door order

    def start(self, header: str, notes: Sequence[str]) -> None:
        self._print(Text(header, style="bold"))
        for note in notes:
            self._print(Text(f"note: {note}", style="yellow"))

    def step(self, record: Any, idle: str = IDLE) -> None:
        fields = {name: value for name, value in record.to_json().items() if name != "step" and value}
        for request_id, reason in fields.get("rejected", ()):
            self._reasons.setdefault(request_id, []).append(reason)
        if not fields and not (self.explain and record.explain):
            if self._idle is not None and self._idle[1] == record.step - 1 and self._idle[2] == idle:
                self._idle = (self._idle[0], record.step, idle)
            else:
                self.flush()
                self._idle = (record.step, record.step, idle)
            return
        self.flush()
        lines = [Text(f"step {record.step}", style="bold cyan")]
        width = max(map(len, fields), default=0)
        for name, value in fields.items():
            lines.append(self._hanging(f"  {name:<{width}}  ", format_field(name, value), "green"))
        if self.explain:
            lines += [self._hanging("    - ", sentence, "dim", style="italic") for sentence in record.explain]
        self._print(Text("\n").join(lines))

    def flush(self) -> None:
        """Print the pending run of idle steps as one line."""
        if self._idle is None:
            return
        first, last, why = self._idle
        self._idle = None
        title = f"step {first}" if first == last else f"steps {first}–{last}"
        self._print(Text(title, style="bold cyan") + Text(f": {why}", style="dim"))

    def _hanging(self, lead: str, body: str, lead_style: str, style: str = "") -> Text:
        """``lead`` then ``body`` wrapped to the console width, continuation lines indented under it."""
        lines = wrap_words(body, max(20, self.console.width - len(lead)))
        text = Text(lead, style=lead_style)
        text.append(("\n" + " " * len(lead)).join(lines), style=style)
        return text

    def finish(self, summary: Sequence[Mapping[str, Any]], outputs: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.flush()
        self._print(Text(""))
        if not summary:
            self._print(Text("no requests", style="dim"))
            return
        reasons = {rid: list(found) for rid, found in self._reasons.items()}
        shown = []
        for entry in summary:
            found = reasons.get(entry["request_id"])
            if entry["state"] == "REJECTED" and found:
                entry = {**entry, "state": f"REJECTED ({found.pop(0)})"}
            shown.append(entry)
        header, *rows = summary_lines(shown, self.columns)
        self._print(Text("\n").join([Text(header, style="bold"), Text("\n".join(rows))]))
        if outputs:
            self._print(Text(""))
            self._print(Text("text", style="bold"))
            width = max(len(str(out["request_id"])) for out in outputs)
            for out in outputs:
                # json.dumps keeps each text on one line (newlines escaped) and shows its edges (quotes)
                text = json.dumps(out["text"], ensure_ascii=False)
                self._print(Text(f"{out['request_id']:<{width}}  ") + Text(text))

    def _print(self, text: Text) -> None:
        self.console.print(text, soft_wrap=True)


def format_field(name: str, value: Any) -> str:
    """A trace field's JSON value as text; ``rejected``'s ``[id, reason]`` pairs read ``id=REASON``."""
    if name == "rejected":
        return ", ".join(f"{request_id}={reason}" for request_id, reason in value)
    return format_value(value)


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` split at spaces into lines of at most ``width`` characters (a longer word keeps its own line)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]


SUMMARY_COLUMNS = (
    ("request", "request_id", "<"),
    ("state", "state", "<"),
    ("finish", "finish_reason", "<"),
    ("generated", "generated", ">"),
    ("computed", "computed", ">"),
)


def summary_lines(
    summary: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]] = SUMMARY_COLUMNS
) -> list[str]:
    """A header and one aligned row per request: state, finish reason, generated, computed (``columns``:
    (title, key, alignment) each)."""
    rows = [[title for title, _, _ in columns]]
    rows += [[_cell(entry[key]) for _, key, _ in columns] for entry in summary]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    aligns = [align for _, _, align in columns]
    return ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, aligns, widths)).rstrip() for row in rows]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


# m15: a fleet's run.  Its records hold a routing decision per arrived request and every replica's record.
class FleetJsonView(JsonView):
    """``JsonView`` for a fleet: one line per fleet step (``FleetRecord.to_json()``: ``step``,
    ``routed`` decisions with their rule and reason, ``replicas`` with each record and its KV events),
    then ``{"summary": [...]}`` with each request's ``replica``."""


class FleetTextView(TextView):
    """The readable view of a fleet: per step, ``routed`` (``request -> replica (rule)``), then each
    replica with something in its record, its fields indented under it; with ``explain`` each
    decision's reason and each replica's sentences.  Idle steps collapse as in ``TextView``; the
    summary table gains a ``replica`` column."""

    columns = (
        ("request", "request_id", "<"),
        ("replica", "replica", ">"),
        ("state", "state", "<"),
        ("finish", "finish_reason", "<"),
        ("generated", "generated", ">"),
        ("computed", "computed", ">"),
    )

    def step(self, record: Any, idle: str = IDLE) -> None:
        doc = record.to_json()
        replicas = []
        for rep, rec in zip(doc["replicas"], record.replicas):
            fields = {name: value for name, value in rep["record"].items() if name != "step" and value}
            for request_id, reason in fields.get("rejected", ()):
                self._reasons.setdefault(request_id, []).append(reason)
            if fields or (self.explain and rec.explain):
                replicas.append((rep["replica"], fields, rec.explain))
        if not doc["routed"] and not replicas:
            if self._idle is not None and self._idle[1] == record.step - 1 and self._idle[2] == idle:
                self._idle = (self._idle[0], record.step, idle)
            else:
                self.flush()
                self._idle = (record.step, record.step, idle)
            return
        self.flush()
        lines = [Text(f"step {record.step}", style="bold cyan")]
        if doc["routed"]:
            routed = ", ".join(f"{d['request_id']} -> {d['replica']} ({d['rule']})" for d in doc["routed"])
            lines.append(self._hanging("  routed  ", routed, "green"))
            if self.explain:
                lines += [self._hanging("    - ", d["reason"], "dim", style="italic") for d in doc["routed"]]
        for index, fields, sentences in replicas:
            lines.append(Text(f"  replica {index}", style="bold"))
            width = max(map(len, fields), default=0)
            for name, value in fields.items():
                lines.append(self._hanging(f"    {name:<{width}}  ", format_field(name, value), "green"))
            if self.explain:
                lines += [self._hanging("      - ", sentence, "dim", style="italic") for sentence in sentences]
        self._print(Text("\n").join(lines))
