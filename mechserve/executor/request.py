"""The request record that crosses the boundary: ``ExecutorRequest`` (standard library only).

What an executor needs to know of a request when the door has accepted it travels in one frozen
record, never as loose arguments beside it (vLLM's ``EngineCoreRequest`` plays this part there)::

    EngineCore.add_request ── ExecutorRequest.of(id, prompt ids, params, tokenizer, EOS ids, grammar)
                               (every tokenizer-derived field is derived here, once per request)
        └─> Executor.add_request(record) ── TorchExecutor: one per-request state built from it
                                         └─ RankGroup: ("add", record) to every rank process

A new field the executor needs from the tokenizer (as ``bad_words_ids``) is a field here, derived in
``of``, and read where it acts (the sampler reads ``Row.request``).

The record is plain data with one exception, the compiled grammar (an llguidance matcher template
bound to this process's tokenizer).  ``to_dict``/``from_dict`` give it as builtins only (str, int,
float, bool, None, lists and string-keyed dicts): what a schema-checked transport (msgpack or JSON,
never pickle from the network) carries between processes.  The compiled grammar serialises to
nothing: it is a function of ``params.structured_outputs`` (which travels) and the tokenizer, so the
receiving process compiles it again with its own ``GrammarCompiler`` (``from_dict(..., compile=)``,
cached by the constraint's key).  Between the processes of one machine (the rank pipes) the record is
pickled as it is; a grammar does not cross there (structured outputs run on one rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mechserve.api.errors import ParamError
from mechserve.api.params import GREEDY, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from mechserve.executor.structured import CompiledGrammar


@dataclass(frozen=True, slots=True)
class ExecutorRequest:
    """One accepted request as an executor sees it (one per sample: ``request_id`` is m14's id).

    ``prompt_ids``: the prompt the engine runs (after truncation); ``params``: the sample's
    ``SamplingParams`` (default greedy); ``eos_token_ids``: the model's end ids (they end the request unless
    ``params.ignore_eos``; the grammar's end too); ``bad_words_ids``: ``params.bad_words`` as token ids
    (``bad_words_ids``); ``grammar``: ``params.structured_outputs`` compiled for this model's tokenizer
    (None for an unconstrained request; left out of equality and of ``to_dict``).
    """

    request_id: str
    prompt_ids: tuple[int, ...] = ()
    params: SamplingParams = GREEDY
    eos_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    grammar: CompiledGrammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids if w))

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        grammar: CompiledGrammar | None = None,
    ) -> ExecutorRequest:
        """The record of a request, its tokenizer-derived fields derived with ``tokenizer`` (None: a model
        without one).  Raises ``ParamError`` for bad words without a tokenizer or outside the vocabulary."""
        return cls(
            request_id,
            tuple(prompt_ids),
            params,
            tuple(eos_token_ids),
            bad_words_ids(params.bad_words, tokenizer, vocab_size),
            grammar,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def end_ids(self) -> tuple[int, ...]:
        """The ids that end the request: its stop ids, and its EOS ids unless it ignores EOS."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys((*self.params.stop_token_ids, *eos)))

    def to_dict(self) -> dict[str, Any]:
        """The record as builtins only (module docstring); the compiled grammar is left out."""
        return {
            "request_id": self.request_id,
            "prompt_ids": list(self.prompt_ids),
            "params": params_to_dict(self.params),
            "eos_token_ids": list(self.eos_token_ids),
            "bad_words_ids": [list(w) for w in self.bad_words_ids],
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], compile: Callable[[StructuredOutputsParams], CompiledGrammar] | None = None
    ) -> ExecutorRequest:
        """The record ``to_dict`` gave; a constrained request's grammar is compiled again with ``compile``
        (a ``GrammarCompiler.compile`` of the receiving process).  Raises ``ValueError`` for a malformed
        dict, or a constrained request without ``compile`` (it would otherwise run unconstrained)."""
        unknown = set(data) - {"request_id", "prompt_ids", "params", "eos_token_ids", "bad_words_ids"}
        if unknown:
            raise ValueError(f"ExecutorRequest: unknown field(s) {sorted(unknown)}")
        params = params_from_dict(data["params"])
        grammar = None
        if params.structured_outputs is not None:
            if compile is None:
                raise ValueError(f"{data['request_id']}: a constrained request needs a grammar compiler to be rebuilt")
            grammar = compile(params.structured_outputs)
        return cls(
            str(data["request_id"]),
            tuple(int(t) for t in data["prompt_ids"]),
            params,
            tuple(int(t) for t in data.get("eos_token_ids", ())),
            tuple(tuple(int(t) for t in w) for w in data.get("bad_words_ids", ())),
            grammar,
        )


def bad_words_ids(words: Sequence[str], tokenizer: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """``words`` as token ids, vLLM's way (``SamplingParams.update_from_tokenizer``): each word as given
    (leading spaces stripped), and with one leading space when that spells it with as many tokens but
    another first token (a word inside the text, not at its start).

    Raises ``ParamError("bad_words", ...)`` without a tokenizer or for an id outside ``vocab_size``."""
    if not words:
        return ()
    if tokenizer is None:
        raise ParamError("bad_words", "bad_words need a tokenizer; this model was loaded without one")
    found: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
        spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
        if plain:
            found.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            found.append(spaced)
    bad = next((t for w in found for t in w if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError("bad_words", f"bad_words: token {bad} is outside this model's vocabulary")
    return tuple(found)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """``params`` as builtins: every field by name (tuples as lists, ``logit_bias`` as ``[id, bias]`` pairs,
    ``structured_outputs`` as a dict of the kind it sets); ``params_from_dict`` inverts it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name == "logit_bias" and value is not None:
            value = [[int(k), float(v)] for k, v in value.items()]
        elif f.name == "structured_outputs" and value is not None:
            so: StructuredOutputsParams = value
            value = {k: _plain(getattr(so, k)) for k in ("json", "regex", "choice", "grammar") if getattr(so, k)}
            if so.json_object:
                value["json_object"] = True
        out[f.name] = _plain(value)
    return out


def params_from_dict(data: Mapping[str, Any]) -> SamplingParams:
    """The ``SamplingParams`` ``params_to_dict`` gave (checked again); ``ValueError`` for a malformed dict."""
    fields = dict(data)
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(fields) - names
    if unknown:
        raise ValueError(f"SamplingParams: unknown field(s) {sorted(unknown)}")
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"]}
    return SamplingParams(**fields)


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (what msgpack and JSON carry)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


__all__ = ["ExecutorRequest", "bad_words_ids", "params_from_dict", "params_to_dict"]
