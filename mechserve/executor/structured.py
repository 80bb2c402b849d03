"""Grammar-constrained decoding on llguidance: compiled grammars, per-request matchers, token masks.

Why llguidance (``/work/research/grammar-eval/REPORT.md``, re-measured by ``mechserve bench structured``,
``docs/benchmarks.md``): it compiles a JSON schema in 0.5-7 ms (xgrammar 6-124 ms, outlines-core
seconds), handles this tokenizer's special tokens correctly, *reports* JSON-schema keywords it does
not implement instead of ignoring them, checks a whole draft without mutating (``validate_tokens``),
rolls back any number of tokens exactly and clones a matcher in ~2 us; its per-token mask (~30 us)
is slower than xgrammar's (~7 us) but under 1% of a CPU decode step.  It is a 3 MB wheel with no
dependencies (xgrammar pulls triton, ~1 GB).

The pieces::

    GrammarCompiler(tokenizer, vocab_size)   one per engine: the llguidance tokenizer (built on first use,
                                              ~1 s for a 49k vocabulary) and an LRU of compiled grammars
      .compile(StructuredOutputsParams)  ->  CompiledGrammar   (ParamError "structured_outputs" when it
                                              does not compile; thread-safe: callers compile before
                                              admission, never on the engine's step loop)
    CompiledGrammar.matcher(eos_ids)     ->  GrammarMatcher    (a deep copy of the template matcher)
    GrammarMatcher                            one per constrained request, in the executor:
      .sync(output_ids)                       roll back / consume to exactly these output ids (a rejected
                                              guess, a preemption, a stop cut: the history decides)
      .window_masks(guesses, out, row0)       the masks of a sampling item's rows: row j is the matcher's
                                              state after the first j guesses; a guess the grammar forbids
                                              ends the valid rows there (later rows are never reached)
      .forced_tokens()                        the ids the grammar allows as the only continuation now

A mask is llguidance's int32 bitmask ``[R, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32`` set =
token ``t`` allowed); ``allowed_rows`` unpacks it to bool ``[R, V]`` with numpy (no ``torch.compile``:
llguidance's own kernel compiles for ~50 s on first use on CPU).

Hostile constraints are refused at compile time, never met in the step: a constraint's text is at most
``MAX_GRAMMAR_CHARS`` characters; llguidance runs on a thread of its own with a large stack
(``COMPILE_STACK_BYTES``: a 3,000-rule chain overflows an 8 MiB stack and crashes the process); and
``compile`` *probes* the grammar the way the step will use it (the first mask, then a few seeded
walks of sampled tokens, each computing masks, forced tokens and consuming) under llguidance's
default resource limits (``PROBE_LIMITS``), while the step's matchers get twice those limits
(``STEP_LIMITS``), so a grammar that passed has headroom.  Each llguidance call is bounded by its
fuel and item limits; between calls the probe stops after ``COMPILE_CPU_SECONDS`` of CPU time.
What this catches, each a ``ParamError`` that says why: an empty language (a ``$ref`` that only
refers to itself, ``[^\\x00-\\U0010FFFF]``: llguidance's ``NoExtensionBias`` at the first mask), a
grammar too complex for the parser (a 2,001-way alternative: a row of 2,002 Earley items after
the first token), a lexer that runs out of fuel.  A failed key is remembered, so resending it costs
nothing.  Errors never carry the grammar (llguidance's ``verbose_errors`` is off).

JSON defaults: no free whitespace (``whitespace_flexible: false``, separators ``,`` and ``:``), so a
small model cannot loop on whitespace and the forced runs are long; a schema's own ``x-guidance``
object overrides these (llguidance's option order: defaults, then ``x-guidance``); ``\\uXXXX``
escapes are allowed (``json_allow_general_unicode_escapes``).  The end: llguidance's EOS bit is set
only where the grammar accepts; every EOS id of the request shares that bit.

Closed objects (``close_objects``): an object schema that lists ``properties`` (or
``patternProperties``) and says nothing about other properties (no ``additionalProperties``, no
``unevaluatedProperties``) allows no other properties, as vLLM's default grammar backend does
(xgrammar's ``strict_mode``, on by default: unstated extra properties default to false, while a bare
``{"type": "object"}`` stays any object; vLLM's llguidance backend gets the same with
``disable_additional_properties``).  JSON Schema's own default is the opposite (extra properties
allowed), and under it a small model fills an object with properties it invents until it runs out of
tokens.  ``GrammarCompiler(allow_additional_properties=True)`` (``EngineConfig``, ``mechserve serve
--allow-additional-properties``) keeps JSON Schema's semantics.  Members of an ``allOf`` are left as
they are: closing each would forbid the properties the others add.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from mechserve.api.errors import ParamError
from mechserve.api.params import MAX_GRAMMAR_CHARS, StructuredOutputsParams

T = TypeVar("T")

# Compiled grammars kept per engine (an LRU by the constraint's key), and refused keys with their reason.
GRAMMAR_CACHE_SIZE = 256
# llguidance's LLParserLimits for the compile-time probe: its own defaults for the work of one call.
PROBE_LIMITS: dict[str, int] = {
    "max_items_in_row": 2_000,  # Earley items in one row
    "step_lexer_fuel": 200_000,  # lexer work per mask (~14k/ms)
    "step_max_items": 50_000,  # Earley items per mask (~20k/ms)
    "max_lexer_states": 50_000,  # lexer states (1-2 kB each; llguidance's default is 250,000)
}
# ... and for the matchers the step runs: twice as much, so a grammar the probe passed has headroom.
STEP_LIMITS: dict[str, int] = {name: 2 * value for name, value in PROBE_LIMITS.items()}
PROBE_WALKS = 4  # seeded walks from the start
PROBE_TOKENS = 16  # tokens consumed per walk (each after a mask and the forced tokens)
COMPILE_CPU_SECONDS = 2.0  # CPU time one compile (build and probe) may take, checked between llguidance calls
COMPILE_STACK_BYTES = 512 << 20  # the compile thread's stack: llguidance recurses once per nesting level
MAX_COMPILES = 2  # compiles running at once (the rest wait): hostile ones cannot take every core
JSON_DEFAULTS: Any = {  # llguidance's JsonCompileOptions
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "json_allow_general_unicode_escapes": True,
}


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12 and
# draft 7); close_objects walks these and nothing else, so a ``const``, ``enum`` or ``default`` value is never
# mistaken for a schema.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, *, in_all_of: bool = False) -> Any:
    """A copy of the JSON schema ``schema`` in which every object schema that lists ``properties`` or
    ``patternProperties`` and sets neither ``additionalProperties`` nor ``unevaluatedProperties`` gets
    ``"additionalProperties": false`` (xgrammar's ``strict_mode``, vLLM's default); nested schemas too
    (properties, items, ``anyOf``/``oneOf``, ``$defs``, ...), but not an ``allOf``'s members themselves.
    A bare ``{"type": "object"}`` stays any object.  ``schema`` is not changed; a value that is not an
    object (``true``, ``false``) comes back as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(sub, in_all_of=True) for sub in out["allOf"]]
    for key in _ONE_SCHEMA:
        if key in out:
            sub = out[key]
            out[key] = [close_objects(s) for s in sub] if isinstance(sub, list) else close_objects(sub)
    lists_properties = "properties" in out or "patternProperties" in out
    states_others = "additionalProperties" in out or "unevaluatedProperties" in out
    if lists_properties and not states_others and not in_all_of:
        out["additionalProperties"] = False
    return out


def grammar_text(so: StructuredOutputsParams, *, allow_additional_properties: bool = False) -> str:
    """The llguidance grammar for ``so`` (its JSON form); raises ``ParamError`` when it cannot be built
    (a bad JSON text, a GBNF grammar that does not convert).  A JSON schema's objects are closed
    (``close_objects``) unless ``allow_additional_properties``."""
    import llguidance as llg

    try:
        if so.json is not None:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            if not allow_additional_properties:
                schema = close_objects(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if so.json_object:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if so.regex is not None:
            return llg.grammar_from("regex", so.regex)
        if so.choice is not None:
            return llg.grammar_from("choice", json.dumps(list(so.choice)))
        assert so.grammar is not None
        return llg.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ParamError(
            "structured_outputs", f"structured_outputs.{so.kind} cannot be compiled: {_line(str(e))}"
        ) from None


class CompiledGrammar:
    """One compiled constraint: a template ``LLMatcher`` that each request's matcher deep-copies
    (sharing the lazily built lexer caches, which makes later requests' masks 2-3x cheaper)."""

    def __init__(self, key: tuple[str, str], template: Any, eos_token: int, vocab_size: int) -> None:
        self.key = key
        self._template = template
        self._lock = threading.Lock()  # deep_copy from the caller's thread and the engine's
        self.eos_token = eos_token
        self.vocab_size = vocab_size

    def matcher(self, eos_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher at the start of the output; ``eos_token_ids``: the request's end ids (each one
        is the grammar's end)."""
        with self._lock:
            m = self._template.deep_copy()
        return GrammarMatcher(self, m, eos_token_ids)

    def fresh(self) -> Any:
        with self._lock:
            return self._template.deep_copy()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer, caching compiled grammars by key.

    ``tokenizer``: a Hugging Face tokenizer (llguidance reads its vocabulary); ``vocab_size``: the
    model's logits width V (ids the tokenizer lacks are never allowed); ``allow_additional_properties``:
    JSON Schema's open objects instead of closed ones (``close_objects``).  ``compile`` may be called
    from any thread (llguidance drops the GIL while it builds).  Raises ``ParamError`` (param
    ``structured_outputs``) for a tokenizer llguidance cannot read (e.g. one with no EOS).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_size: int = GRAMMAR_CACHE_SIZE,
        *,
        allow_additional_properties: bool = False,
    ) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.allow_additional_properties = allow_additional_properties
        self._lltok: Any = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> the refusal's message
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_COMPILES)
        self.compiled = 0  # grammars built (cache misses)

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance.hf

            try:
                self._lltok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            except Exception as e:  # llguidance raises several types for a tokenizer it cannot read
                raise ParamError(
                    "structured_outputs", f"structured outputs need a byte-level tokenizer with an EOS token: {e}"
                ) from None
        return self._lltok

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``so`` (cached by ``so.key``), checked the way the step will use it.

        Raises ``ParamError("structured_outputs", ...)`` naming the problem: a constraint over
        ``MAX_GRAMMAR_CHARS`` characters, an unsupported JSON-schema keyword (llguidance reports
        ``Unimplemented keys: ["not"]``), an unknown name in a grammar with its line and column, a bad
        regex, an empty language, a grammar too complex for llguidance's limits, or a compile over
        ``COMPILE_CPU_SECONDS`` of CPU time.  A refused key is remembered and refused again at once."""
        key = so.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            refused = self._refused.get(key)
        if refused is not None:
            raise ParamError("structured_outputs", refused)
        if len(key[1]) > MAX_GRAMMAR_CHARS:
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.{so.kind} is {len(key[1])} characters; at most {MAX_GRAMMAR_CHARS} are compiled",
            )
        with self._slots:
            try:
                compiled = on_large_stack(lambda: self._build(so))
            except ParamError as exc:
                with self._lock:
                    self._refused[key] = str(exc)
                    while len(self._refused) > self.cache_size:
                        self._refused.popitem(last=False)
                raise
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Build, probe, then build the step's template (on the compile thread)."""
        import llguidance as llg

        deadline = time.thread_time() + COMPILE_CPU_SECONDS
        with self._lock:
            lltok = self._tokenizer()
        text = grammar_text(so, allow_additional_properties=self.allow_additional_properties)
        probe_limits = _limits(PROBE_LIMITS)
        bad, messages = llg.LLMatcher.validate_grammar_with_warnings(text, lltok, limits=probe_limits)
        if bad:
            raise _refusal(so, "cannot be compiled", _line(messages[0]))
        probe = llg.LLMatcher(lltok, text, log_level=0, limits=probe_limits)
        problem = probe_grammar(probe, lltok.eos_token, self.vocab_size, deadline)
        if problem is not None:
            raise _refusal(so, "cannot be served", problem)
        template = llg.LLMatcher(lltok, text, log_level=0, limits=_limits(STEP_LIMITS))
        if template.is_error():
            raise _refusal(so, "cannot be compiled", _line(template.get_error()))
        return CompiledGrammar(so.key, template, lltok.eos_token, self.vocab_size)


def _limits(values: dict[str, int]) -> Any:
    """llguidance's ``LLParserLimits`` with ``values``; its errors never carry the grammar (``verbose_errors``)."""
    import llguidance as llg

    return llg.LLParserLimits(
        max_items_in_row=values["max_items_in_row"],
        step_lexer_fuel=values["step_lexer_fuel"],
        step_max_items=values["step_max_items"],
        max_lexer_states=values["max_lexer_states"],
        verbose_errors=False,
    )


def _line(text: str, limit: int = 300) -> str:
    """An llguidance message on one line, at most ``limit`` characters (it may quote the grammar)."""
    flat = " ".join(text.replace("<non-verbose/>", "").split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _refusal(so: StructuredOutputsParams, what: str, why: str) -> ParamError:
    return ParamError("structured_outputs", f"structured_outputs.{so.kind} {what}: {why}")


def probe_grammar(matcher: Any, eos_token: int, vocab_size: int, deadline: float) -> str | None:
    """Run ``matcher`` (a fresh llguidance ``LLMatcher``) as the step will: ``PROBE_WALKS`` seeded walks of up
    to ``PROBE_TOKENS`` tokens, each position computing the mask and the forced tokens, then consuming a
    sampled allowed token (never the end while anything else is allowed).  Returns why the grammar cannot
    be served (llguidance's error in words), or None.  ``deadline``: ``time.thread_time()`` to stop at."""
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for walk in range(PROBE_WALKS):
        rng = random.Random(walk)
        for position in range(PROBE_TOKENS):
            if time.thread_time() > deadline:
                return f"checking it took more than {COMPILE_CPU_SECONDS:g} s of CPU time"
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if matcher.is_error():
                return _matcher_problem(matcher)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
            if position == 0 and walk == 0 and not len(allowed):
                return _EMPTY
            choices = allowed[allowed != eos_token]
            if not len(choices):
                break  # complete: only the end may follow
            matcher.compute_ff_tokens()
            if not matcher.is_error():
                matcher.consume_token(int(choices[rng.randrange(len(choices))]))
            if matcher.is_error():
                return _matcher_problem(matcher)
            if matcher.is_stopped():
                break
        matcher.reset()
    return None


_EMPTY = (
    "it allows no output at all (nothing can match it: e.g. a $ref that only refers to itself, or a "
    "character class that matches no character)"
)


def _matcher_problem(matcher: Any) -> str:
    """An llguidance matcher's error state in words (never the grammar: its errors are not verbose)."""
    reason = str(matcher.stop_reason())  # "InternalError" for most: the error's text names the cause
    detail = _line(matcher.get_error())
    if detail.startswith(("NoExtension", "NoExtensionBias")):
        return _EMPTY
    if reason == "ParserTooComplex" or detail.startswith("Parser Error"):
        return f"it is too complex for the grammar engine ({detail})"
    if reason == "LexerTooComplex" or "lexer" in detail.lower():
        return f"its regular expressions are too complex for the grammar engine ({detail})"
    return detail


_STACK_LOCK = threading.Lock()


def on_large_stack(fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh thread with a ``COMPILE_STACK_BYTES`` stack (llguidance recurses once per nesting
    level of a grammar: an 8 MiB stack overflows, killing the process, at ~3,000 levels); returns its result
    or raises its exception in the caller."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    with _STACK_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="mechserve-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result


class GrammarMatcher:
    """The grammar state of one constrained request: llguidance's ``LLMatcher`` after ``tokens``.

    Only ids the grammar allows are ever consumed (``validate_tokens`` first: an invalid id would put
    llguidance's matcher in a permanent error state); a request's EOS ids all map to the grammar's
    end.  Not thread-safe: the executor's step uses it.
    """

    def __init__(self, grammar: CompiledGrammar, matcher: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self._m = matcher
        self.tokens: list[int] = []  # output ids consumed so far
        self.eos_ids = frozenset(eos_token_ids) | {grammar.eos_token}
        self.rebuilds = 0
        self._ends = 0  # trailing ends consumed after the grammar stopped (llguidance takes none of them)

    def _grammar_ids(self, ids: Sequence[int]) -> list[int]:
        eos = self.grammar.eos_token
        return [eos if t in self.eos_ids else t for t in ids]

    def sync(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to the state after exactly ``output_ids`` (the request's kept output).

        Rolls back past the first id that differs (a rejected guess, a cut, a recompute after
        preemption) and consumes the rest; rebuilds from a fresh copy when the matcher is in an
        error state.  Raises ``ValueError`` if ``output_ids`` is not a string of the grammar (the
        engine only ever emits ids sampled under the mask)."""
        ids = list(output_ids)
        if self._m.is_error():
            self.rebuild(ids)
            return
        common = 0
        mine = self.tokens
        limit = min(len(mine), len(ids))
        while common < limit and mine[common] == ids[common]:
            common += 1
        if common < len(mine):
            if not self._rollback(len(mine) - common):
                self.rebuild(ids)
                return
            del mine[common:]
        self._consume(ids[common:])

    def rebuild(self, output_ids: Sequence[int]) -> None:
        """A fresh matcher that consumed ``output_ids`` (after preemption, or when the state was lost)."""
        self._m = self.grammar.fresh()
        self.tokens = []
        self._ends = 0
        self.rebuilds += 1
        self._consume(list(output_ids))

    def _rollback(self, n: int) -> bool:
        """Undo the last ``n`` consumed ids (ends past a stopped grammar first: llguidance never saw them)."""
        ends = min(n, self._ends)
        self._ends -= ends
        return n == ends or bool(self._m.rollback(n - ends))

    def _consume(self, ids: list[int]) -> None:
        if not ids:
            return
        g = self._grammar_ids(ids)
        valid = self._valid_len(g)
        if valid < len(g):
            raise ValueError(
                f"output id {ids[valid]} at output position {len(self.tokens) + valid} is not allowed by the grammar"
            )
        self._advance(g)
        self.tokens += ids

    def _advance(self, g: list[int]) -> int:
        """Consume grammar ids ``g`` (already validated); ends after a stopped grammar are only counted.
        Returns how many ids llguidance consumed."""
        eos = self.grammar.eos_token
        take = len(g)
        while take and g[take - 1] == eos and (self._ends or take > int(self._m.validate_tokens(g[:take]))):
            take -= 1  # a trailing end the stopped grammar refuses to consume
        if take and not self._m.consume_tokens(g[:take]):
            raise ValueError(f"the grammar matcher failed: {self._m.get_error()}")
        self._ends += len(g) - take
        return take

    def valid_prefix(self, guesses: Sequence[int]) -> int:
        """How many leading ``guesses`` the grammar allows from the current state (nothing changes)."""
        return self._valid_len(self._grammar_ids(guesses)) if guesses else 0

    def _valid_len(self, g: list[int]) -> int:
        """The valid prefix of grammar ids ``g``.  Once the grammar is complete and stopped (nothing else
        can follow), llguidance's ``validate_tokens`` refuses the end although an end is exactly what
        may come: ends there count as valid."""
        eos = self.grammar.eos_token
        v = 0 if self._ends else int(self._m.validate_tokens(g))
        if v < len(g) and g[v] == eos:
            stopped = bool(self._ends)
            if not stopped:
                if v:
                    self._m.consume_tokens(g[:v])
                stopped = bool(self._m.is_stopped())
                if v:
                    self._m.rollback(v)
            while stopped and v < len(g) and g[v] == eos:
                v += 1
        return v

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the current state's mask into ``bitmask[row]`` (int32 ``[R, ceil(V/32)]``)."""
        v = bitmask[row]
        if self._ends:
            v.zero_()
        else:
            self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        if not bool(v.any()):  # stopped (after an end): only an end may follow
            set_bit(bitmask, row, self.grammar.eos_token)

    def window_masks(self, guesses: Sequence[int], bitmask: torch.Tensor, row0: int) -> int:
        """Masks of a sampling item's ``len(guesses) + 1`` rows into ``bitmask[row0 ...]``; returns how many
        leading guesses are valid (``v``).

        Row ``j <= v`` is the state after ``guesses[:j]``: the mask at a window row is the matcher
        after the guesses before it, so a guess is verified against exactly the grammar state its
        position has.  Guess ``v`` (if any) is forbidden at row ``v``, so the verdict can accept no
        guess after it; rows past ``v`` copy row ``v`` (computed, never reached).  The matcher is
        left where it was."""
        v = self.valid_prefix(guesses)
        g = self._grammar_ids(guesses[:v])
        ends_before = self._ends
        consumed = 0
        for j in range(v + 1):
            self.fill(bitmask, row0 + j)
            if j < v:
                consumed += self._advance([g[j]])
        if consumed:
            self._m.rollback(consumed)
        self._ends = ends_before
        for j in range(v + 1, len(guesses) + 1):
            bitmask[row0 + j] = bitmask[row0 + v]
        return v

    def forced_tokens(self) -> list[int]:
        """The ids the grammar allows as the only continuation now (llguidance's fast-forward tokens;
        the last, still extendable token is left out).  Empty when there is a choice."""
        return list(self._m.compute_ff_tokens())

    def only_token(self) -> int | None:
        """The one id the grammar's mask allows now, or None when it allows several or only an end.

        What forced runs (m14) append: unlike llguidance's fast-forward tokens (a canonical
        tokenization of the forced text, while the mask may allow other spellings of it), an id
        that is the mask's only one is what greedy and every seeded sample would pick, so forcing
        it changes no id."""
        if self._ends or self._m.is_stopped():
            return None
        bitmask = new_bitmask(1, self.grammar.vocab_size)
        self.fill(bitmask, 0)
        words = bitmask.numpy().view(np.uint32)[0]
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]])
        if word & (word - 1):
            return None
        token = int(nonzero[0]) * 32 + word.bit_length() - 1
        return None if token in self.eos_ids or token >= self.grammar.vocab_size else token

    def accept(self, ids: Sequence[int]) -> None:
        """Consume ``ids`` appended without sampling (forced tokens); ``ValueError`` if the grammar forbids one."""
        self._consume(list(ids))

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete string of the grammar (an end is allowed now)."""
        return bool(self._m.is_accepting())

    def is_stopped(self) -> bool:
        """Whether nothing but an end can follow."""
        return bool(self._m.is_stopped())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask ``[rows, ceil(vocab_size / 32)]``."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Allow ``token`` in ``bitmask[row]``."""
    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
    word |= 1 << (token % 32)
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


def allowed_rows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[R, vocab_size]``: which ids each row of an int32 bitmask ``[R, W]`` allows (numpy's
    vectorised ``unpackbits``; little-endian words, so byte ``t // 8`` bit ``t % 8`` is token ``t``)."""
    raw = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
    bits = np.unpackbits(raw, axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def is_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether ``bitmask[row]`` allows ``token``."""
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


__all__ = [
    "COMPILE_CPU_SECONDS",
    "GRAMMAR_CACHE_SIZE",
    "JSON_DEFAULTS",
    "PROBE_LIMITS",
    "STEP_LIMITS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "allowed_rows",
    "close_objects",
    "grammar_text",
    "is_allowed",
    "new_bitmask",
    "on_large_stack",
    "probe_grammar",
    "set_bit",
]
