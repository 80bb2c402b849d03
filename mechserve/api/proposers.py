"""The speculative methods: one registry of proposers, read by everything that needs a method's facts
(standard library only).

A method's name (``SpeculativeConfig.method``, ``--spec-method``, vLLM's ``speculative_config``) is
looked up here and nowhere else compared as a string::

    PROPOSERS[name] -> ProposerMethod
        build(ProposerContext) -> Proposer     what proposes the guesses, behind the boundary (named as
                                               "module:name", imported when first built)
        needs_model                            a model of its own (SpeculativeConfig.draft_model), loaded next
                                               to the target by the engine (mechserve.model.draft)
        page_bytes(model, page_size)           what its own KV adds to each page of the pool (None: nothing)
        governor(proposer, model, target, max_k)  the adaptive governor's prior price of its draft rounds
                                               (None: rounds priced free, executor.governor.Governor());
                                               the executor then measures the real costs (executor.costs)
        ranks                                  whether it runs on tensor-parallel ranks (world_size > 1)
        hidden                                 the target forward also returns its final hidden states at the
                                               sampling rows, and the executor hands each request's kept rows
                                               to the proposer's ``observe`` (an EAGLE head)
        options                                the SpeculativeConfig fields only it reads (a --flag each, the
                                               field's name in dashes); another method refuses them set
        model_field                            the SpeculativeConfig field vLLM's ``model`` names for it
                                               (``draft_model``; an EAGLE head's directory: ``eagle_head``)

Read by: ``api/config.py`` (``SpeculativeConfig`` checks the method and its model), the CLI
(``--spec-method``'s choices, ``serve``'s startup line), the engine (loading the method's model, its
page cost, refusing it on ranks), and the executor, also in every rank process (``build``, ``governor``).

Adding a model-free proposer is two files: its class (``executor/proposers.py``, or its own module:
``propose(windows)``, ``available(request, history, cap)``, ``release(request, output_ids)``, see the
``Proposer`` protocol there) and its entry below.  One with its own model also sets ``needs_model``,
``page_bytes`` and ``governor``, and loads through ``SpeculativeConfig.draft_model``
(``mechserve.model.draft.load_draft_model``: a Llama-family checkpoint with the target's vocabulary);
a model of another shape (the EAGLE head, ``mechserve.model.eagle``) loads in its own ``build`` and sets
``hidden`` to be fed the target's hidden states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer is built from, behind the boundary: ``speculative`` (the ``SpeculativeConfig``),
    the target ``model``, the method's own ``draft`` model (None for a model-free method), the pool's
    geometry (``num_pages`` pages of ``page_size`` positions, KV in ``kv_dtype``, None: the model's) and
    the executor's ``sampler`` (a ``mechserve.executor.sampling.Sampler``)."""

    speculative: Any
    model: Any
    draft: Any
    num_pages: int
    page_size: int
    sampler: Any
    kv_dtype: Any = None


@dataclass(frozen=True, slots=True)
class ProposerMethod:
    """One speculative method (module docstring): ``name``, a ``summary`` for people (the server's startup
    line, ``--help``) and the facts the engine needs before anything is built.

    ``build``, ``page_bytes`` and ``governor`` name functions as ``"module:qualified.name"`` (vLLM's model
    registry does the same), imported only when the engine first needs them: the registry is read by
    ``api/config.py`` and the CLI, which must not import torch, and the proposers' modules import the
    model and the sampler.  ``tests/executor/test_proposer_registry.py`` resolves every entry.
    """

    name: str
    summary: str
    build: str
    needs_model: bool = False
    ranks: bool = True
    hidden: bool = False
    page_bytes: str | None = None
    model_field: str = "draft_model"
    governor: str | None = None
    options: tuple[str, ...] = ()

    def builder(self) -> Callable[[ProposerContext], Any]:
        """``build`` imported: ``(ProposerContext) -> Proposer``."""
        return resolve(self.build)

    def page_cost(self, model: Any, page_size: int) -> int:
        """Bytes the method's own KV adds to each page of the pool (0 without a model, or without ``page_bytes``)."""
        if model is None or self.page_bytes is None:
            return 0
        return int(resolve(self.page_bytes)(model, page_size))

    def new_governor(self, proposer: Any, model: Any, target: Any, max_k: int) -> Any:
        """The governor that prices this method's guesses (``executor.governor.Governor``): ``governor`` called
        with the built ``proposer``, the method's own ``model`` (None for a model-free method), the ``target``
        and ``max_k``, the most guesses per window; without ``governor``, draft rounds are priced free."""
        if self.governor is None:
            from importlib import import_module

            return import_module("mechserve.executor.governor").Governor()
        return resolve(self.governor)(proposer, model, target, max_k)


PROPOSERS: Mapping[str, ProposerMethod] = {
    m.name: m
    for m in (
        ProposerMethod(
            "ngram",
            "prompt lookup",
            "mechserve.executor.proposers:NgramProposer.build",
            options=("ngram_min", "ngram_max"),
        ),
        ProposerMethod(
            "suffix",
            "suffix decoding over this request and past outputs",
            "mechserve.executor.proposers_suffix:SuffixProposer.build",
            options=(
                "suffix_decoding_max_tree_depth",
                "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor",
                "suffix_decoding_min_token_prob",
            ),
        ),
        ProposerMethod(
            "draft",
            "draft model",
            "mechserve.executor.proposers:DraftModelProposer.build",
            needs_model=True,
            ranks=False,
            page_bytes="mechserve.engine.pool:page_bytes",
            governor="mechserve.executor.governor:draft_governor",
        ),
        ProposerMethod(
            "eagle",
            "an EAGLE head trained on the model (mechserve train-draft)",
            "mechserve.executor.proposers_eagle:EagleProposer.build",
            ranks=False,
            hidden=True,
            options=("eagle_head", "eagle_draft_vocab"),
            model_field="eagle_head",
            governor="mechserve.executor.proposers_eagle:eagle_governor",
        ),
    )
}
METHODS = tuple(PROPOSERS)
# Every method's own options (ProposerMethod.options).
METHOD_OPTIONS: Mapping[str, str] = {option: m.name for m in PROPOSERS.values() for option in m.options}
# The method of a speculative_config that names no method: prompt lookup, or with a model the model-based one.
DEFAULT_METHOD = "ngram"
DEFAULT_MODEL_METHOD = "draft"
# vLLM's spellings of our methods.
ALIASES: Mapping[str, str] = {"draft_model": "draft"}


def resolve(path: str) -> Any:
    """The object ``"module:qualified.name"`` names (imported now)."""
    from importlib import import_module

    module, _, name = path.partition(":")
    found: Any = import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def proposer_method(name: str) -> ProposerMethod:
    """The registered method ``name`` (or vLLM's alias of one); ``ValueError`` naming the choices otherwise."""
    method = PROPOSERS.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {name!r}")
    return method


__all__ = [
    "ALIASES",
    "DEFAULT_METHOD",
    "DEFAULT_MODEL_METHOD",
    "METHODS",
    "METHOD_OPTIONS",
    "PROPOSERS",
    "ProposerContext",
    "ProposerMethod",
    "proposer_method",
    "resolve",
]
