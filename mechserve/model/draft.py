"""The draft model of speculative decoding: loading ``MODEL[:layers=N]`` next to the target, and checking it fits.

``smollm2:layers=4`` keeps the first 4 of SmolLM2's 30 layers (sharing the target's weights when the
target is the same model); a directory names any checkpoint of a registered family with the same
vocabulary.  Both are ``model.protocol.Model``s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mechserve.api.config import parse_draft_model
from mechserve.model.protocol import Model


def load_draft_model(
    spec: str, target: Model, *, target_path: Path | None = None, target_tokenizer: Any | None = None
) -> Model:
    """The draft model for ``spec`` (``MODEL[:layers=N]``) next to the ``target`` model (``Model.truncated``).

    When ``MODEL`` resolves to ``target_path`` (the target's checkpoint directory), the draft shares
    the target's weights (``layers=N`` keeps the first N layers); otherwise it is loaded in the
    target's dtype.  Raises ``ValueError`` when ``N`` exceeds the model's layers or the vocabularies
    differ (size, or the tokenizers' token -> id maps), ``ModelLoadError`` when it cannot be loaded.
    """
    from mechserve.api.errors import ModelLoadError
    from mechserve.model.checkpoint import resolve_model
    from mechserve.model.loader import load_model

    name, layers = parse_draft_model(spec)
    try:
        if target_path is not None and _same_path(resolve_model(name), target_path):
            base, tokenizer = target, None
        else:
            loaded = load_model(name, dtype=target.dtype, tokenizer=target_tokenizer is not None)
            base, tokenizer = loaded.model, loaded.tokenizer
    except ModelLoadError as exc:  # say which model: the target loaded fine
        raise ModelLoadError(f"draft model {spec!r}: {exc}") from None
    if layers is not None and layers > base.arch.num_layers:
        raise ValueError(f"draft model {spec!r}: layers={layers}, but the model has {base.arch.num_layers}")
    draft = base.truncated(layers) if layers is not None else base
    check_vocabulary(draft, target, tokenizer, target_tokenizer, spec)
    return draft


def check_vocabulary(draft: Model, target: Model, draft_tok: Any, target_tok: Any, spec: str) -> None:
    """Raise ``ValueError`` unless ``draft`` can propose ids for ``target``: the same vocabulary size and,
    when both tokenizers are known, the same token -> id map."""
    dv, tv = draft.arch.vocab_size, target.arch.vocab_size
    if dv != tv:
        raise ValueError(f"draft model {spec!r} has a vocabulary of {dv} ids, the target {tv}: they must share it")
    if draft_tok is not None and target_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(f"draft model {spec!r} has a different tokenizer: the draft must share the target's")


def _same_path(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def weight_share(draft: Model, target: Model) -> tuple[float, float]:
    """``(layers, head)``: the draft's decoder-layer and LM-head weights as fractions of the target's
    whole per-step weight read (layers + head), the cost model's unit of a batch-1 decode step."""
    dl, dh = draft.weight_elements()
    tl, th = target.weight_elements()
    return dl / (tl + th), dh / (tl + th)


__all__ = ["check_vocabulary", "load_draft_model", "weight_share"]
