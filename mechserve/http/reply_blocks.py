"""A reply as a sequence of blocks, text and tool calls, in the order the model wrote them.

OpenAI's Responses API answers with output items (a message, a function call, ...) and Anthropic's
Messages API with content blocks (``text``, ``tool_use``); both stream each one as "started, grew by
this much, ended".  ``ReplyBlocks`` gives that view of one reply's text, from the same parser as chat's
``tool_calls`` (``mechserve.entrypoints.tools.ToolStream``, in its ordered form), so the three APIs
agree on what is a call::

    feed("Let me look. <tool_call>{...}</tool_call>")  ->  open text 0, delta "Let me look.",
                                                           close 0, open call 1 (id, name, arguments)
    finish()                                           ->  close 1

A block of text ends when a call starts (or the reply ends); a call ends when the next block starts or
the reply ends, so a forced function's arguments grow while they stream.  Without active tools
everything is one text block.  A whole reply is ``feed(text) + finish()``: the same blocks a stream of it
gives (``ToolStream`` holds back what might still turn out to be a call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mechserve.entrypoints.tools import Piece, ToolPlan, ToolStream


@dataclass(slots=True)
class Block:
    """One block of a reply: ``text`` (its text so far) or a ``call`` (its ``call_id``, the function's
    ``name`` and ``text``, the arguments' JSON text so far)."""

    kind: Literal["text", "call"]
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """``open``, ``delta`` (``text`` was appended) or ``close`` of ``blocks[index]``."""

    kind: Literal["open", "delta", "close"]
    index: int
    block: Block
    text: str = ""


class ReplyBlocks:
    """One reply (one sample) parsed into blocks as its text arrives; ``tools``: the request's tool plan."""

    def __init__(self, tools: ToolPlan | None = None) -> None:
        self.parser = ToolStream(tools) if tools is not None and tools.active else None
        self.blocks: list[Block] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # tool call index -> block index

    @property
    def calls(self) -> list[Block]:
        """The reply's tool calls so far."""
        return [b for b in self.blocks if b.kind == "call"]

    def feed(self, text: str) -> list[BlockEvent]:
        """The events of ``text`` (the reply's next piece)."""
        pieces: list[Piece] = self.parser.feed_ordered(text) if self.parser is not None else [text]
        return self._apply(pieces)

    def finish(self) -> list[BlockEvent]:
        """The events of the reply's end: what was held back, then the last block's close."""
        events = self._apply(self.parser.finish_ordered()) if self.parser is not None else []
        if self._open is not None:
            events.append(BlockEvent("close", self._open, self.blocks[self._open]))
            self._open = None
        return events

    def _apply(self, pieces: list[Piece]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if self._open is None or self.blocks[self._open].kind != "text":
                    events += self._start(Block("text"))
                events += self._grow(self._open, piece)
            elif "id" in piece:
                function = piece["function"]
                events += self._start(Block("call", call_id=str(piece["id"]), name=str(function["name"])))
                self._calls[int(piece["index"])] = len(self.blocks) - 1
                events += self._grow(self._open, str(function.get("arguments") or ""))
            else:
                events += self._grow(self._calls[int(piece["index"])], str(piece["function"].get("arguments") or ""))
        return events

    def _start(self, block: Block) -> list[BlockEvent]:
        events = []
        if self._open is not None:
            events.append(BlockEvent("close", self._open, self.blocks[self._open]))
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        events.append(BlockEvent("open", self._open, block))
        return events

    def _grow(self, index: int | None, text: str) -> list[BlockEvent]:
        if index is None or not text:
            return []
        block = self.blocks[index]
        block.text += text
        return [BlockEvent("delta", index, block, text)]


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments as an object: its JSON text, or as much of it as was written when ``max_tokens`` cut
    it (``pydantic_core``'s partial JSON: ``{"city": "Par`` is ``{"city": "Par"}``); ``{}`` if none of it is."""
    import json

    from pydantic_core import from_json

    try:
        found = json.loads(text)
    except ValueError:
        try:
            found = from_json(text, allow_partial="trailing-strings")
        except ValueError:
            found = None
    return found if isinstance(found, dict) else {}


__all__ = ["Block", "BlockEvent", "ReplyBlocks", "arguments_object"]
