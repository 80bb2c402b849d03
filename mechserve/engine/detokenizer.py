"""Incremental detokenization and stop strings: token ids in, streamable text out (standard library only).

Two problems, one per class:

``IncrementalDetokenizer`` turns ids into text one id at a time without ever
emitting half a character.  A byte-level tokenizer may split one character
over several tokens (SmolLM2 spells "✓" as three), so decoding each id alone
gives U+FFFD.  As vLLM does, we decode a short window of ids twice, the
already-read context alone and the whole window, and emit the difference;
only a trailing run of U+FFFD (the first bytes of an unfinished character)
waits for the next id::

    window:  c0 c1 ... | t0  t1         c = read (context), t = pending
    new text = decode(c + t) - decode(c) - what of it was already sent, minus a trailing U+FFFD run

Once the pending ids' text is complete they become the next window's
context, so the window stays a few ids long.  The first window starts with
the last ``CONTEXT_TOKENS`` prompt ids, so that a decoder sees context (a
SentencePiece leading space, a merged byte).  A U+FFFD in the middle of the
text is a real invalid byte the model produced, and is kept; ``flush``
releases a trailing one when the output ends.

``StopStrings`` searches the text for stop strings and decides what may be
streamed.  Each search looks only at newly added text plus a lookback of
``len(stop) - 1`` characters, so a stop string that spans a token boundary
or sits inside one token (stop "DE" in token "DEF", field case BC19) is
found the moment its last character arrives.  The earliest occurrence wins:
the one that is complete first, reading left to right (among occurrences
complete at the same character, the one that starts first).  Streamed text
holds back the longest suffix that is a proper prefix of some stop string,
so no chunk ever carries characters that a later match would retract.

``OutputText`` puts the two together for one output (one sample of one
request): push ids, get the matched stop string, take streamable deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt ids that give the first window its context.
CONTEXT_TOKENS = 5

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Ids in, completed text out; never half a character.

    ``decode`` turns a list of ids into text (a tokenizer's ``decode`` with
    its options bound); ``prompt_ids`` give the first window its context
    (their own text is never emitted).  A token that ends with the first
    bytes of a character releases the characters before them at once: only
    the trailing U+FFFD run waits.
    """

    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = (), context: int = CONTEXT_TOKENS) -> None:
        self._decode = decode
        # The window: ids[:read] were read (context), ids[read:] are pending; `sent` characters of
        # the pending ids' text are already out.
        self._ids = list(prompt_ids[-context:]) if context > 0 else []
        self._read = len(self._ids)
        self._sent = 0

    def push(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished byte sequence, as the decoder renders it); call once, at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        stable = new_text if final else new_text.rstrip(REPLACEMENT)
        start = len(prefix_text) + self._sent
        delta = stable[start:] if len(stable) > start else ""
        self._sent += len(delta)
        if len(stable) == len(new_text) and len(new_text) > len(prefix_text):
            # Every pending id is fully out: they become the next window's context.
            del self._ids[: self._read]
            self._read, self._sent = len(self._ids), 0
        return delta


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string found in the text: ``stop`` occupies ``text[start:end]``."""

    stop: str
    start: int
    end: int


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> StopMatch | None:
    """The earliest occurrence of any of ``stops`` that ends in the last ``new_chars`` characters of ``text``.

    Earliest means complete first (smallest end); ties go to the one that
    starts first.  Each stop ``s`` is searched from ``len(text) - new_chars -
    len(s) + 1``: an occurrence that ended before the new characters was
    already looked for.
    """
    if new_chars <= 0:
        return None
    best: StopMatch | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start < 0:
            continue
        match = StopMatch(stop, start, start + len(stop))
        if best is None or (match.end, match.start) < (best.end, best.start):
            best = match
    return best


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStrings:
    """The text of one output, searched for stop strings, with a streaming cursor.

    ``stops`` are the stop strings; with ``include_stop`` a matched stop
    string stays in the text.  ``add`` appends text and reports a match
    (after which nothing more may be added); ``take`` returns the text that
    can be streamed now.
    """

    def __init__(self, stops: Sequence[str] = (), include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.text = ""
        self.match: StopMatch | None = None
        self._sent = 0

    def add(self, text: str, check: bool = True) -> StopMatch | None:
        """Append ``text``; with ``check``, search it (plus the lookback) and cut the text at a match.

        Raises ``RuntimeError`` if a stop string already matched.
        """
        if self.match is not None:
            raise RuntimeError("text added after a stop string matched")
        self.text += text
        if not check or not self.stops:
            return None
        match = find_stop(self.text, self.stops, len(text))
        if match is not None:
            self.match = match
            self.text = self.text[: match.end if self.include_stop else match.start]
        return match

    def take(self, final: bool = False) -> str:
        """The text not yet taken that no future match can retract (all of it when ``final`` or matched)."""
        end = len(self.text)
        if not final and self.match is None:
            end -= held_suffix(self.text, self.stops)
        if end <= self._sent:
            return ""
        chunk = self.text[self._sent : end]
        self._sent = end
        return chunk


class OutputText:
    """The text of one output: ids are detokenized incrementally and searched for stop strings.

    ``decode`` and ``prompt_ids`` as for ``IncrementalDetokenizer``; ``stops``,
    ``include_stop`` as for ``StopStrings``; stop strings are not searched
    until the output has ``min_tokens`` ids (vLLM's rule).
    """

    def __init__(
        self,
        decode: Decode,
        prompt_ids: Sequence[int] = (),
        stops: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detok = IncrementalDetokenizer(decode, prompt_ids)
        self._stops = StopStrings(stops, include_stop)
        self.min_tokens = min_tokens
        self.num_ids = 0
        self._flushed = False

    @property
    def text(self) -> str:
        """All text so far (cut at a matched stop string), held-back characters included."""
        return self._stops.text

    @property
    def stop(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stops.match.stop if self._stops.match else None

    def push(self, token_id: int, detokenize: bool = True) -> str | None:
        """Append one id; return the stop string it completes, if any.

        ``detokenize=False`` counts the id without adding its text (an ending
        EOS or stop id).  Raises ``RuntimeError`` after a match or a flush.
        """
        if self._stops.match is not None or self._flushed:
            raise RuntimeError("id pushed after the output ended")
        self.num_ids += 1
        if not detokenize:
            return None
        text = self._detok.push(token_id)
        match = self._stops.add(text, check=self.num_ids >= self.min_tokens)
        return match.stop if match else None

    def finish(self) -> str | None:
        """The output ends: release held-back bytes; return a stop string they complete, if any."""
        if self._stops.match is not None or self._flushed:
            return None
        self._flushed = True
        match = self._stops.add(self._detok.flush(), check=self.num_ids >= self.min_tokens)
        return match.stop if match else None

    def take(self, final: bool = False) -> str:
        """Text that can be streamed now (everything left when ``final``)."""
        return self._stops.take(final)


__all__ = [
    "CONTEXT_TOKENS",
    "IncrementalDetokenizer",
    "OutputText",
    "StopMatch",
    "StopStrings",
    "find_stop",
    "held_suffix",
]
