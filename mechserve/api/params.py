"""Per-request sampling parameters, as in vLLM's ``SamplingParams`` (standard library only).

Validation happens at construction: a bad value raises ``ParamError`` (a
``ValueError``) naming the field, so a request that can never be served never
reaches the engine.  Checks that need the model (a token id outside the
vocabulary, a bad word that does not tokenize) happen at submission, in
``EngineCore.add_request``.
"""

from __future__ import annotations

import json as _json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mechserve.api.errors import ParamError
from mechserve.api.limits import (
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_FILTER_IDS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS_IDS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
)

# vLLM's _SAMPLING_EPS: a temperature below it is greedy.
SAMPLING_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's (and vLLM's) range for presence/frequency penalties: [-2, 2]


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output, vLLM's ``StructuredOutputsParams`` (exactly one kind set).

    * ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it.
    * ``regex``: the output matches the regular expression as a whole.
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: a context-free grammar, Lark/EBNF as llguidance reads it, or llama.cpp's GBNF
      (recognised by its ``::=`` rules).
    * ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    Whether a schema, regex or grammar compiles is checked when the request is submitted (the
    grammar engine is behind the boundary); here only the shape is checked.  Raises ``ParamError``
    with ``param="structured_outputs"`` unless exactly one kind is set and it has the right type.
    """

    json: dict[str, Any] | str | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is True:
            set_kinds.append("json_object")
        elif self.json_object is not False:
            raise ParamError(
                "structured_outputs", f"structured_outputs.json_object must be a boolean, got {self.json_object!r}"
            )
        if len(set_kinds) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {set_kinds or 'none'}",
            )
        if self.json is not None:
            ok = isinstance(self.json, dict) or (isinstance(self.json, str) and 0 < len(self.json) <= MAX_GRAMMAR_CHARS)
            _so_check(
                ok, f"structured_outputs.json must be a JSON schema (an object or its JSON text), got {self.json!r:.80}"
            )
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ParamError("structured_outputs", f"structured_outputs.json is not valid JSON: {e}") from None
                _so_check(
                    isinstance(schema, dict | bool),
                    f"structured_outputs.json must be a JSON schema (an object), got {schema!r:.80}",
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _so_check(
                    isinstance(value, str) and 0 < len(value) <= MAX_GRAMMAR_CHARS,
                    f"structured_outputs.{name} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters",
                )
        if self.choice is not None:
            ch = self.choice
            _so_check(
                not isinstance(ch, str) and 0 < len(ch) <= MAX_CHOICES and all(isinstance(c, str) and c for c in ch),
                f"structured_outputs.choice must be a list of 1..{MAX_CHOICES} non-empty strings, got " + _summary(ch),
            )

    @property
    def kind(self) -> str:
        """The kind set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """A hashable key naming the constraint (compiled grammars are cached by it)."""
        if self.json is not None:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return ("json", _json.dumps(schema, sort_keys=True))
        if self.choice is not None:
            return ("choice", _json.dumps(list(self.choice)))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """``value`` as ``StructuredOutputsParams``: itself, or a dict of its fields (vLLM accepts both).

        Raises ``ParamError("structured_outputs", ...)`` for another type or an unknown key."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ParamError("structured_outputs", f"structured_outputs must be an object, got {value!r:.80}")
        known = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParamError(
                "structured_outputs",
                f"structured_outputs has unknown keys {unknown}; known: {sorted(known)}",
            )
        return cls(**{k: v for k, v in value.items() if v is not None})


def _summary(value: Any) -> str:
    """A list-like value as its length and first items, never the whole of it (at most ~80 characters)."""
    if isinstance(value, list | tuple) and not isinstance(value, str):
        head = repr(list(value[:3]))[:60]
        return f"{len(value)} item(s): {head}{' ...' if len(value) > 3 or len(head) == 60 else ''}"
    return f"{value!r:.80}"


def _so_check(ok: bool, message: str) -> None:
    if not ok:
        raise ParamError("structured_outputs", message)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    * ``temperature`` (>= 0; below 1e-5 means greedy, as in vLLM), ``top_k`` (0 or -1 = off, else the
      k most likely tokens), ``top_p`` (in (0, 1]: the smallest set whose
      probability reaches p), ``min_p`` (in [0, 1]: drop tokens below
      ``min_p`` x the top probability).  Applied in that order: temperature,
      top-k, top-p, min-p (vLLM's order).
    * ``seed``: a seeded request's token ``i`` is drawn from a generator seeded
      by ``(seed, i)`` alone, so it never depends on which other requests share
      the batch, nor on preemption or speculation.
    * ``max_tokens`` (>= 0; 0 finishes at once with no token), ``min_tokens``
      (EOS and stop ids are masked until this many tokens exist; stop strings
      are not checked before it).
    * ``stop``: strings that end the output (not included in the text unless
      ``include_stop_str_in_output``); ``stop_token_ids``: ids that end it
      (finish reason ``stop``); ``ignore_eos``: the model's EOS is an ordinary
      token.
    * ``logprobs``: return the top-N log-probabilities (0..20) of the model's
      raw distribution (before temperature, penalties and masks, vLLM's
      default) at each generated position, plus the chosen token's.
    * ``prompt_logprobs``: the same (top-N plus the prompt token's own) at
      every prompt position but the first (vLLM's ``prompt_logprobs``).
    * ``n``: independent samples per prompt (each a separate request; with a
      seed, sample ``j`` uses ``seed + j``).
    * Penalties and token filters, vLLM's semantics (``vllm/v1/sample/sampler.py``,
      ``vllm/v1/sample/ops/penalties.py``, ``vllm/v1/sample/ops/bad_words.py``), applied to the
      raw logits in this order before temperature::

          allowed_token_ids   every other id is masked (-inf); None = all allowed, [] is refused
          bad_words           strings; each is tokenized (as is and with a leading space); a one-token
                              word is always masked, a longer one masks its last token only when the
                              output so far ends with the word's other tokens
          min_tokens          EOS and stop ids masked while the output is shorter than min_tokens
          logit_bias          {id: bias}, bias in [-100, 100], added to the logit
          repetition_penalty  (> 0, 1 = off) every id in the prompt or the output so far:
                              a positive logit is divided by it, a negative one multiplied
          frequency_penalty   ([-2, 2]) subtracted once per occurrence of the id in the output so far
          presence_penalty    ([-2, 2]) subtracted once if the id occurs in the output so far

      "The output so far" at a position is every token before it, so a decode window's guess
      positions count the guesses before them (speculation changes nothing).
    * ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: the model's context).
    * ``structured_outputs``: a ``StructuredOutputsParams`` (or a dict of its fields): the output is
      constrained to a JSON schema, any JSON object, a regex, a choice or a grammar.  The grammar's
      mask applies after every other filter; a constrained request's EOS is allowed only where the
      grammar accepts.

    Raises ``ParamError`` (a ``ValueError`` whose ``param`` names the field) on any out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default=())
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_value(self.structured_outputs))
        # Accept a bare string / any sequence for the list fields, store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else _sequence("stop", self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _sequence("stop_token_ids", self.stop_token_ids))
        bad = (self.bad_words,) if isinstance(self.bad_words, str) else _sequence("bad_words", self.bad_words)
        object.__setattr__(self, "bad_words", bad)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _sequence("allowed_token_ids", self.allowed_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            _is_real(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"
        )
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or > 0, got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens!r}")
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        _check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop),
            f"stop must be non-empty strings of at most {MAX_STOP_CHARS} characters, got {_summary(stop)}",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {_summary(self.stop_token_ids)}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_finite(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}",
            )
        _check(
            _is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
        )
        allowed = self.allowed_token_ids
        _check(
            allowed is None or (0 < len(allowed) <= MAX_FILTER_IDS and all(_is_int(t) and t >= 0 for t in allowed)),
            f"allowed_token_ids must be a non-empty list of at most {MAX_FILTER_IDS} token ids, got {_summary(allowed)}",
        )
        _check(
            len(bad) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() for w in bad),
            f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings, got {_summary(bad)}",
        )
        _check(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
            ),
            f"truncate_prompt_tokens must be >= 1, or -1 (the model's context), got {self.truncate_prompt_tokens!r}",
        )

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty is set (the sampler then needs the history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def filtered(self) -> bool:
        """Whether any logit processing beyond temperature and the truncations applies: a penalty, a
        bias, allowed ids or bad words (min_tokens bans are the sampler's own)."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature below ``SAMPLING_EPS``, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def for_sample(self, j: int) -> SamplingParams:
        """The params of the ``j``-th of ``n`` samples: ``n = 1`` and, if seeded, ``seed + j``."""
        seed = None if self.seed is None else self.seed + j
        return replace(self, n=1, seed=seed)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # NaN is not a value


def _is_finite(x: object) -> bool:
    return _is_real(x) and math.isfinite(x)  # type: ignore[arg-type]


def _logit_bias(value: Any) -> dict[int, float]:
    """``{id: bias}`` as a dict of ints to floats; ``ParamError`` for another shape or a bias out of range."""
    if not isinstance(value, Mapping):
        raise ParamError("logit_bias", f"logit_bias must be a mapping of token id to bias, got {value!r:.80}")
    _check(
        len(value) <= MAX_LOGIT_BIAS_IDS,
        f"logit_bias must name at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(value)}",
    )
    out: dict[int, float] = {}
    for key, bias in value.items():
        _check(_is_int(key) and key >= 0, f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        _check(
            _is_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for id {key}",
        )
        out[key] = float(bias)
    return out


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    """``value`` (a list, tuple or other non-text sequence; None or empty: none) as a tuple; ``ParamError``
    naming ``name`` for anything else (a number, a mapping, bytes), never a bare ``TypeError``."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise ParamError(name, f"{name} must be a list, got {type(value).__name__} {value!r:.80}")
    return tuple(value)


def _check(ok: bool, message: str) -> None:
    """Raise ``ParamError`` for ``message`` (which starts with the field's name) unless ``ok``."""
    if not ok:
        raise ParamError(message.split(" ", 1)[0], message)


GREEDY = SamplingParams(temperature=0.0)

__all__ = [
    "GREEDY",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_PENALTY",
    "SAMPLING_EPS",
    "SamplingParams",
    "StructuredOutputsParams",
]
