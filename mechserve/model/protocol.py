"""What the engine and the executor need of a model: the ``Model`` protocol, and its shape.

Everything behind the boundary that runs a model (``TorchExecutor``, ``DraftModelProposer``, the
conformance targets, the benchmarks) and everything that sizes one (``engine/pool.py``,
``EngineCore``) is typed against these protocols, never against a model class, so a new model
family is a class that satisfies ``Model`` plus one line of ``model/registry.py``.

Three levels, each a subset of the next::

    ModelArch    the numbers: layers, heads, KV heads, head dim, vocabulary, context, sliding windows
    ModelShape   a model without its weights: its ``arch``, ``dtype`` and ``quantization``
                 (what the driver of tensor-parallel ranks holds; what pool sizing reads)
    Model        a model that runs: one ``forward`` per engine step over the paged KV cache it makes

The KV layout a model needs is ``arch.num_layers`` layers of ``[pages, page_size,
arch.num_kv_heads, arch.head_dim]`` K and V in ``dtype`` (``kv/paged.py`` owns the layout;
``Model.new_cache`` makes one).  A tensor-parallel rank's model describes *its* KV: its
``arch`` counts the KV heads that rank holds.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from mechserve.kv.paged import AttentionBatch, PagedKVCache


class ModelArch(Protocol):
    """The numbers of a model that the engine, the executor and the KV cache read.

    ``num_heads``/``num_kv_heads``: query and KV heads (their ratio is the GQA group the attention
    batch folds); ``head_dim``: elements per head; ``vocab_size``: logits per row;
    ``max_position_embeddings``: the model's context in positions (None when its config has none;
    ``max_model_len`` may not exceed it); ``sliding_windows``: one entry per layer, None for full causal
    attention or the sliding-window length in positions (a decode window is speculation's term, not this).
    """

    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int | None: ...
    @property
    def sliding_windows(self) -> tuple[int | None, ...]: ...


class ModelShape(Protocol):
    """A model's shape without its weights: enough to size a KV pool and check an engine's settings.

    ``dtype``: the activations' and the KV cache's dtype; ``quantization``: ``"q4_1"``/``"q8_0"``
    when the weight matrices are GGUF blocks, else None.
    """

    @property
    def arch(self) -> ModelArch: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def quantization(self) -> str | None: ...


@runtime_checkable
class Model(ModelShape, Protocol):
    """A model that runs one engine step per ``forward`` over a paged KV cache of its own layout.

    ``isinstance(x, Model)`` tells a model from a ``ModelShape`` (one loaded without weights).

    ``device``: where its weights are, its caches are made and its forward computes (each step's
    index tensors are moved there by ``forward``).  ``distinct_sliding_windows``: ``arch.sliding_windows``
    without repeats, in first-seen order (the attention batch builds one mask per distinct sliding window).
    """

    @property
    def device(self) -> torch.device: ...
    @property
    def distinct_sliding_windows(self) -> tuple[int | None, ...]: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        batch: AttentionBatch,
        logit_rows: torch.Tensor | None = None,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One engine step over a flattened batch: every scheduled token of every request as one row.

        ``input_ids``, ``positions``: [T] int64 (on any device); ``cache``: a cache this model made
        (``new_cache``); ``batch``: the step's slot mapping and attention groups
        (``kv.paged.build_attention_batch`` with ``arch.num_heads // arch.num_kv_heads`` and
        ``distinct_sliding_windows``); ``logit_rows``: [R] int64, the rows whose logits are wanted (None: all
        T).  Writes every row's K/V at ``batch.slot_mapping`` before any row reads it; returns
        [R, arch.vocab_size] float32 logits on ``device``.  ``hidden_out`` (a list, or None): receives the
        final hidden states of the same R rows, [R, hidden] float32 after the last norm and before the LM
        head (what a hidden-state proposer such as an EAGLE head is fed); a model that cannot give them
        raises ``NotImplementedError``.
        """
        ...

    def new_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> PagedKVCache:
        """A zeroed KV cache of ``num_pages`` x ``page_size`` slots for this model's layers and KV heads, in
        ``dtype`` (default the model's), on ``device``."""
        ...

    def to(self, device: torch.device | str) -> Model:
        """This model with every tensor on ``device`` (itself when already there).  Raises ``ValueError``
        for a device its weights cannot live on (GGUF blocks are CPU-only)."""
        ...

    def compiled(self) -> Model:
        """This model with its dense work under ``torch.compile`` (the same greedy tokens); a model with
        nothing to compile returns itself."""
        ...

    def truncated(self, num_layers: int) -> Model:
        """This model cut to its first ``num_layers`` layers, sharing its tensors (a draft model for it).
        Raises ``ValueError`` unless ``1 <= num_layers <= arch.num_layers``, ``NotImplementedError`` for a
        model that cannot be cut (a tensor-parallel rank's shard)."""
        ...

    def weight_elements(self) -> tuple[int, int]:
        """``(layers, head)``: elements of the weight matrices one decode step reads in all decoder layers,
        and in the LM head (the governor's cost model for a draft model)."""
        ...


__all__ = ["Model", "ModelArch", "ModelShape"]
