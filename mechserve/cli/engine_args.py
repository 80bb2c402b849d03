"""The engine's flags as one ``EngineConfig``: ``engine_config(args)``, shared by every command that runs a model.

``generate``, ``serve``, ``run --backend torch`` and ``bench run`` each parse their own flags, then build
their engine settings here and nowhere else::

    args (argparse.Namespace) ── every attribute named like an EngineConfig field (None: its default)
                              ── --spec-method/--draft-model/--spec-len/... as one SpeculativeConfig
                              ── --no-output-caching, --no-hold-shared-prefix as the switches they turn off
                              ── overrides (what the command decides itself: a pool sized for one request,
                                 a workload's engine section, a benchmark's sizes)
                              ─> EngineConfig(...)   every value checked there (api/config.py); a bad one
                                                     is a CliError naming its flag

The flags' own types check an engine size as it is parsed (``setting``), with ``api/config.py``'s one
range check, so a bad size fails before the model loads with the same words ``EngineConfig`` uses.
Importing this module is cheap (the standard library and ``mechserve.api``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from mechserve.api.config import EngineConfig, SpeculativeConfig, check_setting
from mechserve.api.proposers import DEFAULT_METHOD, DEFAULT_MODEL_METHOD, METHOD_OPTIONS, proposer_method
from mechserve.cli.errors import CliError

# EngineConfig fields whose flag is not "--" + the field's name with dashes.
FLAGS = {"speculative": "--spec-method", "prefix_caching": "--enable-prefix-caching"}


def flag(field: str) -> str:
    """The command-line flag that sets the ``EngineConfig`` field ``field``."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def setting(name: str) -> Callable[[str], int]:
    """An argparse ``type=`` for the engine size ``name``: an integer in its range (``check_setting``)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        try:
            return check_setting(name, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def engine_config(args: argparse.Namespace, ignore: tuple[str, ...] = (), **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` the parsed flags ask for (module docstring); ``overrides`` win over the flags, and
    ``ignore`` names attributes of ``args`` that are not the engine's (``generate``'s ``--seed`` seeds its
    request, ``bench``'s its workload).

    Raises ``CliError`` naming the flag of a value ``EngineConfig`` refuses (and the speculative flags'
    own combinations: ``speculative_config``)."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ignore:
            fields[f.name] = value
    if getattr(args, "no_output_caching", False):
        fields["output_caching"] = False
    if getattr(args, "no_hold_shared_prefix", False):
        fields["hold_shared_prefix"] = False
    if hasattr(args, "spec_method"):
        fields.pop("spec_len", None)  # --spec-len is the speculative config's num_speculative_tokens
        fields["speculative"] = speculative_config(args)
    fields.update(overrides)
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise CliError(_flag_message(str(exc))) from None


def speculative_config(args: argparse.Namespace) -> Any:
    """The ``SpeculativeConfig`` the flags ask for (None: no speculation); raises ``CliError`` naming the flag."""
    method = args.spec_method or (DEFAULT_MODEL_METHOD if args.draft_model else None)
    speculating = method is not None or bool(args.spec_len)
    in_use = method or DEFAULT_METHOD
    # Every method's own options (the registry's ProposerMethod.options, a flag each, default None: not given).
    options = {name: getattr(args, name) for name in METHOD_OPTIONS if getattr(args, name, None) is not None}
    for name in options:
        owner = METHOD_OPTIONS[name]
        if not speculating:
            raise CliError(
                f"{_flag(name)} is an option of --spec-method {owner}, but speculation is off: "
                f"add --spec-method {owner} (or --spec-len)"
            )
        if owner != in_use:
            raise CliError(f"{_flag(name)} is an option of --spec-method {owner}, but the method in use is {in_use}")
    if not speculating:
        if args.spec_fixed:
            raise CliError("--spec-fixed fixes the guesses per step, but speculation is off: add --spec-len")
        return None
    needs_model = proposer_method(in_use).needs_model
    if needs_model and not args.draft_model:
        raise CliError(f"--spec-method {method} needs --draft-model (e.g. --draft-model smollm2:layers=4)")
    if not needs_model and args.draft_model:
        raise CliError(
            f"--draft-model drafts with a model: use --spec-method {DEFAULT_MODEL_METHOD} (or leave --spec-method out)"
        )
    if args.spec_len == 0:
        raise CliError(f"--spec-method {method} needs --spec-len >= 1 (or leave --spec-len out for 3)")
    low, high = options.get("ngram_min", 1), options.get("ngram_max", 3)
    if low > high:
        raise CliError(f"--ngram-min {low} is more than --ngram-max {high}")
    try:
        return SpeculativeConfig(
            method=method or DEFAULT_METHOD,
            num_speculative_tokens=args.spec_len or 3,
            draft_model=args.draft_model,
            adaptive=not args.spec_fixed,
            **options,
        )
    except ValueError as exc:  # a method's option out of range: name its flag
        message = str(exc)
        for name in options:
            message = message.replace(name, _flag(name))
        raise CliError(message) from None


def _flag(option: str) -> str:
    """The flag of a method's option (``ProposerMethod.options``): its name in dashes."""
    return "--" + option.replace("_", "-")


def _flag_message(message: str) -> str:
    """``EngineConfig``'s message led by the flag of the field it names (``page_size: ...`` ->
    ``--page-size: ...``, ``quantization q4_1 runs ...`` -> ``--quantization: quantization q4_1 runs ...``)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    head, sep, rest = message.partition(":")
    if sep and head in names:
        return f"{flag(head)}:{rest}"
    word = message.partition(" ")[0]
    return f"{flag(word)}: {message}" if word in names else message


__all__ = ["FLAGS", "engine_config", "flag", "setting", "speculative_config"]
