"""A trace to draw: the step records, the summary and, for live runs, one ``Snapshot`` per step.

Two ways in:

* a live run: ``Recorder(engine)`` is called with each step record as the
  engine produces it (``Engine.run(on_step=recorder)``, or once per
  ``EngineCore.step()``), snapshots the engine right after it, and
  ``recorder.trace(summary)`` returns the ``Trace``;
* a saved file: ``parse_trace(text)`` reads either a ``--json`` trace (one
  step record per line, then ``{"summary": ...}``), which holds the steps
  but not the pool (``snapshots is None``: the viewer says which panels that
  leaves out), or a trace document written by ``--viz FILE.json``, which
  holds everything.

The trace document (``FORMAT``) is one JSON object::

    {"format": "mechserve-trace/1", "title": str, "source": "spec" | "model" | "json",
     "engine": {"num_pages": int, "page_size": int},          # what is known
     "requests": [id, ...],                                     # every request, list order
     "steps": [step record + "explain": [sentence, ...], ...],  # --json's fields
     "summary": [...] | null, "outputs": [...] | null, "prompts": {id: text},
     "blocks": [[tokens, text | null], ...],                    # the distinct cached blocks
     "snapshots": null | [{"owners": [code, ...],               # -1 free, -2 cache, i: requests[i]
                           "free": [page, ...],
                           "tree": [[page, parent, block], ...],  # pre-order; parent -1: root; block: blocks[i]
                           "requests": {id: [state, computed, generated, [page, ...]]},
                           "text": {id: text} | null}, ...]}  # a rung without a pool: owners/free null

Owners are codes into ``requests`` rather than ids because a request may
be called ``CACHE``; blocks are shared so that a tree repeated in every
step costs a few numbers per node.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mechserve.viz.snapshot import CACHE, Owner, RequestView, Snapshot, TreeNode, capture

FORMAT = "mechserve-trace/1"
FREE_CODE = -1
CACHE_CODE = -2
SOURCES = ("spec", "model", "json")
# Record fields whose keys (or items) are request ids, in the order a request first shows up.
_ID_FIELDS = ("rejected", "admitted", "scheduled", "executed", "preempted", "finished", "aborted", "tokens")


class TraceError(ValueError):
    """A file that is not a mechserve trace (the message says where and why)."""


@dataclass
class Trace:
    """The steps of one run and what is known about the engine after each.

    ``records`` are step records as ``to_json()`` gives them, plus
    ``"explain"`` where the sentences are known; ``snapshots`` (None for a
    ``--json`` trace) has one entry per record; ``source`` is ``"spec"``
    (a rung's scripted executor), ``"model"`` (a real model: texts are
    known) or ``"json"`` (read from a ``--json`` trace).
    """

    records: list[dict[str, Any]]
    summary: list[dict[str, Any]] | None = None
    outputs: list[dict[str, Any]] | None = None
    snapshots: list[Snapshot] | None = None
    title: str = ""
    source: str = "spec"
    engine: dict[str, int] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)

    def request_ids(self) -> list[str]:
        """Every request of the trace: the summary's order, then any other in order of first appearance."""
        seen: dict[str, None] = {}
        for entry in self.summary or ():
            seen[str(entry["request_id"])] = None
        for record in self.records:
            for name in _ID_FIELDS:
                value = record.get(name) or ()
                for item in value:
                    seen[str(item[0] if name == "rejected" else item)] = None
        for snap in self.snapshots or ():
            seen.update(dict.fromkeys(snap.requests))
            seen.update((o, None) for o in snap.owners or () if isinstance(o, str))
        return list(seen)

    def unavailable(self) -> dict[str, str | None]:
        """Why each of ``pages``, ``tree`` and ``text`` cannot be shown for this trace (None: it can)."""
        no_pool = (
            "a --json trace holds the steps, not the page pool; write a full trace with --viz FILE.json "
            "(or --viz FILE.html) on mechserve demo, run or generate"
        )
        first = self.snapshots[0] if self.snapshots else None
        pages = tree = no_pool if self.snapshots is None else None
        if first is not None and first.owners is None:
            pages = "this rung has no page pool (pages arrive in m03)"
        if first is not None and first.tree is None:
            tree = "this rung has no radix cache (it arrives in m08)"
        text = (
            None if self.source == "model" else "text exists only for real-model runs (generate, run --backend torch)"
        )
        return {"pages": pages, "tree": tree, "text": text}

    def to_document(self) -> dict[str, Any]:
        """The trace as the JSON document of ``FORMAT`` (see the module docstring)."""
        ids = self.request_ids()
        code = {rid: i for i, rid in enumerate(ids)}
        blocks: dict[tuple[tuple[int, ...], str | None], int] = {}
        snapshots = None
        if self.snapshots is not None:
            snapshots = [_snapshot_json(snap, code, blocks) for snap in self.snapshots]
        return {
            "format": FORMAT,
            "title": self.title,
            "source": self.source,
            "engine": dict(self.engine),
            "requests": ids,
            "steps": self.records,
            "summary": self.summary,
            "outputs": self.outputs,
            "prompts": dict(self.prompts),
            "blocks": [[list(tokens), text] for tokens, text in blocks],
            "snapshots": snapshots,
        }

    def dumps(self) -> str:
        """The trace document as compact JSON text."""
        return json.dumps(self.to_document(), separators=(",", ":"), ensure_ascii=False)


def _snapshot_json(
    snap: Snapshot, code: Mapping[str, int], blocks: dict[tuple[tuple[int, ...], str | None], int]
) -> dict[str, Any]:
    owners = None
    if snap.owners is not None:
        owners = [FREE_CODE if o is None else CACHE_CODE if o is CACHE else code[o] for o in snap.owners]
    tree = None
    if snap.tree is not None:
        tree = [[n.page, n.parent, blocks.setdefault((n.tokens, n.text), len(blocks))] for n in snap.tree]
    return {
        "owners": owners,
        "free": None if snap.free is None else list(snap.free),
        "tree": tree,
        "requests": {rid: [v.state, v.computed, v.generated, list(v.page_table)] for rid, v in snap.requests.items()},
        "text": None if snap.text is None else dict(snap.text),
    }


class Recorder:
    """Records a live run: call it with each step record right after the step; ``trace()`` returns the result.

    ``decode`` (real-model runs) turns token ids into text: each request's
    generated text so far, its prompt and the cached blocks are then part of
    every snapshot.  Works with any rung's engine (see ``snapshot.capture``)
    and with an ``EngineCore``'s ``engine``.
    """

    def __init__(self, engine: Any, *, title: str = "", decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.engine = engine
        self.title = title
        self.decode = decode
        self.records: list[dict[str, Any]] = []
        self.snapshots: list[Snapshot] = []
        self._ids: dict[str, list[int]] = {}
        self._text: dict[str, str] = {}
        self._blocks: dict[tuple[int, ...], str] = {}
        self.prompts: dict[str, str] = {}
        self._prompt_ids: dict[str, list[int]] = {}

    def __call__(self, record: Any) -> None:
        """Keep ``record`` (with its explain sentences) and a snapshot of the engine after it."""
        line = record.to_json()
        line["explain"] = list(getattr(record, "explain", ()))
        self.records.append(line)
        text = None
        if self.decode is not None:
            self._learn_prompts()
            for rid, ids in line.get("tokens", {}).items():
                self._ids.setdefault(rid, []).extend(ids)
                self._text[rid] = self._continuation(rid)
            text = dict(self._text)
        block_text = self._block_text if self.decode is not None else None
        self.snapshots.append(capture(self.engine, record.step, text, block_text))

    def _learn_prompts(self) -> None:
        for r in self.engine.requests:
            if r.request_id not in self.prompts and self.decode is not None:
                self._prompt_ids[r.request_id] = list(r.tokens)
                self.prompts[r.request_id] = self.decode(list(r.tokens))

    def _continuation(self, rid: str) -> str:
        """The generated text of ``rid``, decoded after its prompt so the first word keeps its leading space."""
        assert self.decode is not None
        prompt = self.prompts.get(rid)
        if prompt is None:
            return self.decode(self._ids[rid])
        whole = self.decode(self._prompt_ids[rid] + self._ids[rid])
        return whole[len(prompt) :] if whole.startswith(prompt) else self.decode(self._ids[rid])

    def _block_text(self, tokens: Sequence[int]) -> str:
        key = tuple(tokens)
        if key not in self._blocks and self.decode is not None:
            self._blocks[key] = self.decode(key)
        return self._blocks[key]

    def trace(
        self, summary: Sequence[Mapping[str, Any]] | None, outputs: Sequence[Mapping[str, Any]] | None = None
    ) -> Trace:
        """The recorded ``Trace``; ``summary`` is the engine's (None if the run failed before it)."""
        pool = getattr(self.engine, "pool", None)
        engine = {} if pool is None else {"num_pages": pool.num_pages, "page_size": pool.page_size}
        return Trace(
            records=list(self.records),
            summary=None if summary is None else [dict(s) for s in summary],
            outputs=None if outputs is None else [dict(o) for o in outputs],
            snapshots=list(self.snapshots),
            title=self.title,
            source="model" if self.decode is not None else "spec",
            engine=engine,
            prompts=dict(self.prompts),
        )


# Reading ----------------------------------------------------------------------------------------------------------


def parse_trace(text: str, source: str = "trace") -> Trace:
    """A ``Trace`` from a ``--json`` trace or a trace document; ``source`` names the file in errors.

    Raises ``TraceError`` for an empty text, a line that is not JSON, a
    line that is neither a step record nor a summary, or a document that
    does not hold together.
    """
    stripped = text.strip()
    if not stripped:
        raise TraceError(f"{source} is empty, not a trace")
    if stripped.startswith("{"):
        try:
            whole = json.loads(stripped)  # a document is one object; a --json trace has one per line
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "format" in whole:
            return _from_document(whole, source)
    return _from_lines(stripped.splitlines(), source)


def _from_lines(lines: Iterable[str], source: str) -> Trace:
    records: list[dict[str, Any]] = []
    summary = outputs = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}, line {number}: not JSON ({exc.msg}); expected a --json trace") from None
        if isinstance(obj, dict) and _is_int(obj.get("step")):
            if summary is not None:
                raise TraceError(f"{source}, line {number}: a step record after the summary")
            records.append(_record(obj, f"{source}, line {number}"))
        elif isinstance(obj, dict) and isinstance(obj.get("summary"), list):
            if summary is not None:
                raise TraceError(f"{source}, line {number}: a second summary")
            summary = _summary(obj["summary"], f"{source}, line {number}")
            outputs = obj.get("outputs") if isinstance(obj.get("outputs"), list) else None
        else:
            raise TraceError(
                f'{source}, line {number}: neither a step record (an object with an integer "step") nor a '
                "summary; expected a --json trace from mechserve demo, run or generate"
            )
    if not records and summary is None:
        raise TraceError(f"{source} holds no step record and no summary")
    return Trace(records, summary, outputs, None, source="json")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _record(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """A step record, checked just enough that drawing it cannot fail."""
    for name, value in obj.items():
        if name == "step":
            continue
        if name == "explain":
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise TraceError(f'{where}: "explain" must be a list of sentences')
        elif name == "rejected":
            if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
                raise TraceError(f'{where}: "rejected" must be a list of [id, reason] pairs')
        elif name in ("executed", "reused", "published", "drafted", "accepted", "rolled_back"):
            if not isinstance(value, dict) or not all(_is_int(v) for v in value.values()):
                raise TraceError(f'{where}: "{name}" must map request ids to integers')
        elif name in ("sampled", "finished", "tokens") and not isinstance(value, dict):
            raise TraceError(f'{where}: "{name}" must be an object keyed by request id')
        elif name in ("admitted", "scheduled", "preempted", "aborted", "evicted") and not isinstance(value, list):
            raise TraceError(f'{where}: "{name}" must be a list')
    return obj


def _summary(value: list[Any], where: str) -> list[dict[str, Any]]:
    if not all(isinstance(e, dict) and "request_id" in e for e in value):
        raise TraceError(f'{where}: the summary must list objects with a "request_id"')
    return value


def _from_document(doc: dict[str, Any], source: str) -> Trace:
    if doc.get("format") != FORMAT:
        raise TraceError(f"{source}: format {doc.get('format')!r} is not {FORMAT!r}")
    try:
        ids = [str(rid) for rid in doc["requests"]]
        records = [_record(r, f"{source}, step {i}") for i, r in enumerate(doc["steps"])]
        blocks = [(tuple(tokens), text) for tokens, text in doc.get("blocks") or ()]
        raw = doc.get("snapshots")
        snapshots = None if raw is None else [_snapshot(s, r["step"], ids, blocks) for s, r in zip(raw, records)]
        if raw is not None and len(raw) != len(records):
            raise TraceError(f"{source}: {len(raw)} snapshot(s) for {len(records)} step(s)")
        summary = doc.get("summary")
        return Trace(
            records=records,
            summary=None if summary is None else _summary(summary, source),
            outputs=doc.get("outputs"),
            snapshots=snapshots,
            title=str(doc.get("title") or ""),
            source=str(doc["source"]) if doc.get("source") in SOURCES else "spec",
            engine={k: int(v) for k, v in (doc.get("engine") or {}).items()},
            prompts={str(k): str(v) for k, v in (doc.get("prompts") or {}).items()},
        )
    except TraceError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TraceError(f"{source}: not a valid {FORMAT} document ({type(exc).__name__}: {exc})") from None


def _snapshot(obj: dict[str, Any], step: int, ids: Sequence[str], blocks: Sequence[tuple[Any, ...]]) -> Snapshot:
    def owner(c: int) -> Owner:
        return None if c == FREE_CODE else CACHE if c == CACHE_CODE else ids[c]

    owners = obj.get("owners")
    tree = obj.get("tree")
    return Snapshot(
        step=step,
        owners=None if owners is None else tuple(owner(c) for c in owners),
        free=None if obj.get("free") is None else tuple(obj["free"]),
        tree=None if tree is None else tuple(TreeNode(p, parent, *blocks[b]) for p, parent, b in tree),
        requests={rid: RequestView(s, c, g, tuple(t)) for rid, (s, c, g, t) in obj.get("requests", {}).items()},
        text=obj.get("text"),
    )


def read_trace(path: str, stdin: Any = None) -> Trace:
    """The trace in file ``path`` (``-``: ``stdin``); raises ``TraceError`` if it cannot be read or parsed."""
    try:
        if path == "-":
            text = (stdin or sys.stdin).read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise TraceError(f"cannot read trace {path}: {reason}") from None
    return parse_trace(text, "stdin" if path == "-" else path)
