"""The executor under test, as the conformance checks see it: a ``Target``.

A target bundles what the five checks need to know about an executor besides its ``execute``::

    make_executor(num_pages, page_size)  a fresh rank executor with its own KV pages (called once per
                                         rank per run; ranks may share weights)
    kv_of(executor)                      its K and V tensors, [num_layers, num_pages, page_size, ...]
                                         (default: ``executor.cache.k`` / ``executor.cache.v``, the
                                         layout of ``mechserve.kv.paged``)
    dense_kv(token_ids)                  the reference K and V of a dense forward over ``token_ids`` (no
                                         paging, no cache reuse): [num_layers, len(token_ids), ...];
                                         a NaN entry means "no reference" (e.g. outside a sliding window)
    greedy(prompt, n)                    the reference greedy continuation of ``prompt`` generated alone
                                         (at most ``n`` ids; it may stop at an EOS id)
    vocab_size, eos_token_ids            token ids the workloads may use, and the ids that end a request
    atol, rtol                           the KV audit's tolerance: |paged - dense| <= atol + rtol * |dense|

``torch_target`` builds one for a ``Model`` on ``TorchExecutor`` (references from transformers
when its model is given, else from this package's own dense forward), ``tiny_target`` for a built-in
random tiny Llama, ``load_target`` for ``"tiny"``, ``"smollm2"`` or a local model directory.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mechserve.conformance.errors import ConformanceError
from mechserve.model.protocol import Model

KV = tuple[torch.Tensor, torch.Tensor]
"""A (K, V) pair of tensors with the same shape."""

TINY = "tiny"
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
"""The built-in tiny Llama: 2 layers, hidden 64, 4 heads over 2 KV heads, vocabulary 128.  A large
initialisation keeps greedy choices away from near ties, so numerics never flip an argmax."""


def cache_tensors(executor: Any) -> KV:
    """``executor.cache.k`` and ``executor.cache.v`` ([L, P, S, ...] each).

    Raises ``ConformanceError`` when the executor has no such tensors (give ``Target.kv_of``).
    """
    cache = getattr(executor, "cache", None)
    k, v = getattr(cache, "k", None), getattr(cache, "v", None)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ConformanceError(
            f"{type(executor).__name__} has no .cache.k/.cache.v tensors; give the Target a kv_of function"
        )
    return k, v


@dataclass(eq=False)
class Target:
    """An executor under test and its references (see the module docstring for each field).

    ``kv_of``, ``dense_kv`` and ``greedy`` may be None: the checks that need them are then skipped
    (the contract check still checks every outcome, without measuring the writes).  ``model`` is
    informational: the model a ``torch_target`` runs (to build a variant executor over it).
    """

    name: str
    make_executor: Callable[[int, int], Any]
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    kv_of: Callable[[Any], KV] | None = cache_tensors
    dense_kv: Callable[[Sequence[int]], KV] | None = None
    greedy: Callable[[Sequence[int], int], Sequence[int]] | None = None
    atol: float = 1e-4
    rtol: float = 1e-4
    model: Any = None
    _references: dict[tuple[int, ...], tuple[int, list[int]]] = field(default_factory=dict, repr=False)

    def reference(self, prompt: Sequence[int], n: int) -> list[int]:
        """The first ``n`` reference greedy ids after ``prompt`` (fewer if it stopped at EOS), memoised.

        Raises ``ConformanceError`` without a ``greedy`` reference.
        """
        if self.greedy is None:
            raise ConformanceError(f"target {self.name!r} has no greedy reference")
        key = tuple(prompt)
        asked, ids = self._references.get(key, (-1, []))
        if asked < n and not (ids and ids[-1] in self.eos_token_ids):
            ids = [int(t) for t in self.greedy(list(prompt), n)]
            self._references[key] = (n, ids)
        return ids[:n]


# ---- references from transformers ------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars (they go to stderr) for the block."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(level)


def _layer_kv(cache: Any, layer: int) -> KV:
    """Layer ``layer``'s keys and values ([1, KV, N, D] each) from any transformers cache object."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def hf_dense_kv(hf: Any) -> Callable[[Sequence[int]], KV]:
    """Dense K/V from a transformers causal LM: one ``use_cache=True`` forward, batch 1, no padding.

    Returns ``ids -> (K, V)``, each [num_layers, len(ids), num_kv_heads, head_dim] float32; a layer
    whose cache keeps fewer positions (a sliding window) is NaN-padded at the front.
    """

    def dense(ids: Sequence[int]) -> KV:
        n = len(ids)
        with torch.no_grad(), _quiet_transformers():
            out = hf(torch.tensor([list(ids)], dtype=torch.int64), use_cache=True)
        cache = out.get("cache", None)
        if cache is None:
            cache = out.get("past_key_values", None)
        ks, vs = [], []
        for layer in range(hf.config.num_hidden_layers):
            k, v = _layer_kv(cache, layer)
            ks.append(_front_pad(k[0].transpose(0, 1).float(), n))
            vs.append(_front_pad(v[0].transpose(0, 1).float(), n))
        return torch.stack(ks), torch.stack(vs)

    return dense


def _front_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` ([m, ...], m <= n) NaN-padded at the front to [n, ...]."""
    if t.shape[0] >= n:
        return t[t.shape[0] - n :]
    pad = torch.full((n - t.shape[0], *t.shape[1:]), float("nan"), dtype=t.dtype)
    return torch.cat([pad, t])


def hf_greedy(hf: Any, eos_token_ids: Sequence[int] = ()) -> Callable[[Sequence[int], int], list[int]]:
    """transformers' ``generate`` (greedy, batch 1, no padding): ``(prompt, n) -> ids`` (stops at EOS)."""
    eos = list(eos_token_ids)

    def greedy(prompt: Sequence[int], n: int) -> list[int]:
        ids = torch.tensor([list(prompt)], dtype=torch.int64)
        with torch.no_grad(), _quiet_transformers():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0,
            )
        return [int(t) for t in out[0, len(prompt) :].tolist()]

    return greedy


# ---- references from this package's own forward ---------------------------------------------------


def own_dense_kv(model: Model) -> Callable[[Sequence[int]], KV]:
    """Dense K/V from ``model.forward`` over one contiguous page holding exactly the sequence.

    Returns ``ids -> (K, V)``, each [num_layers, len(ids), num_kv_heads, head_dim] in the model dtype.
    """
    from mechserve.kv.paged import Span, build_attention_batch

    def dense(ids: Sequence[int]) -> KV:
        n = len(ids)
        cache = model.new_cache(1, n)
        a = model.arch
        batch = build_attention_batch(
            [Span(0, 0, n, [0])], list(range(n)), n, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows
        )
        positions = torch.arange(n, dtype=torch.int64)
        model.forward(torch.tensor(list(ids), dtype=torch.int64), positions, cache, batch, positions[-1:])
        return cache.k[:, 0, :n].to("cpu", copy=True), cache.v[:, 0, :n].to("cpu", copy=True)

    return dense


def own_greedy(model: Model, eos_token_ids: Sequence[int] = ()) -> Callable[[Sequence[int], int], list[int]]:
    """Greedy ids by a full dense forward per token (no KV reuse): ``(prompt, n) -> ids``, stops at EOS."""
    from mechserve.kv.paged import Span, build_attention_batch

    def greedy(prompt: Sequence[int], n: int) -> list[int]:
        seq, out = list(prompt), []
        a = model.arch
        for _ in range(n):
            m = len(seq)
            batch = build_attention_batch(
                [Span(0, 0, m, [0])], list(range(m)), m, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows
            )
            positions = torch.arange(m, dtype=torch.int64)
            logits = model.forward(
                torch.tensor(seq, dtype=torch.int64), positions, model.new_cache(1, m), batch, positions[-1:]
            )
            token = int(logits[0].argmax())
            out.append(token)
            seq.append(token)
            if token in eos_token_ids:
                break
        return out

    return greedy


# ---- targets -----------------------------------------------------------------------------------------


def torch_target(
    model: Model,
    *,
    hf: Any | None = None,
    name: str = "torch",
    eos_token_ids: Sequence[int] = (),
    atol: float = 1e-4,
    rtol: float = 1e-4,
    **executor_kwargs: Any,
) -> Target:
    """A ``Target`` for ``TorchExecutor(model, num_pages, page_size, **executor_kwargs)``.

    ``hf`` (a transformers causal LM with the same weights) supplies the references: dense K/V from
    its ``use_cache=True`` forward and greedy ids from its ``generate``; without it they come from
    ``model``'s own dense forward.
    """
    from mechserve.executor.torch_executor import TorchExecutor

    eos = tuple(int(t) for t in eos_token_ids)

    def make_executor(num_pages: int, page_size: int) -> TorchExecutor:
        return TorchExecutor(model, num_pages, page_size, **executor_kwargs)

    return Target(
        name=name,
        make_executor=make_executor,
        vocab_size=int(model.arch.vocab_size),
        eos_token_ids=eos,
        dense_kv=hf_dense_kv(hf) if hf is not None else own_dense_kv(model),
        greedy=hf_greedy(hf, eos) if hf is not None else own_greedy(model, eos),
        atol=atol,
        rtol=rtol,
        model=model,
    )


def tiny_model(seed: int = 0) -> tuple[Model, Any]:
    """The built-in tiny random Llama (``TINY_CONFIG``) as ``(Model, transformers model)``, same weights.

    The weights come from ``seed``; the global torch RNG is left as it was.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from mechserve.model.checkpoint import Checkpoint
    from mechserve.model.loader import model_from_checkpoint

    config = AutoConfig.for_model("llama", **TINY_CONFIG)
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    tensors = {name: t.detach().clone() for name, t in hf.state_dict().items()}
    return model_from_checkpoint(Checkpoint(Path(f"<tiny seed {seed}>"), config, tensors)), hf


def tiny_target(seed: int = 0, **executor_kwargs: Any) -> Target:
    """A ``Target`` for ``TorchExecutor`` on the built-in tiny model, references from transformers."""
    model, hf = tiny_model(seed)
    return torch_target(model, hf=hf, name=TINY if seed == 0 else f"{TINY} (weights seed {seed})", **executor_kwargs)


def load_target(model: str = "smollm2", **executor_kwargs: Any) -> Target:
    """``"tiny"``, ``"smollm2"`` (the embedded model), a local Hugging Face directory or a GGUF file, as a ``Target``.

    References come from transformers loading the same (converted) checkpoint in float32 (a GGUF file's
    weights decoded to float32).  Raises
    ``ModelLoadError`` (``mechserve.model.checkpoint``) when the model cannot be loaded.
    """
    if model == TINY:
        return tiny_target(**executor_kwargs)
    from transformers import AutoModelForCausalLM

    from mechserve.api.errors import ModelLoadError
    from mechserve.model.loader import load_model

    loaded = load_model(model, tokenizer=False)
    # issue 30: a GGUF file's reference is transformers on its weights decoded to float32 (its GGUF loader)
    where = {"gguf_file": loaded.path.name} if loaded.path.is_file() else {}
    try:
        with _quiet_transformers():
            hf = AutoModelForCausalLM.from_pretrained(
                loaded.path.parent if where else loaded.path, dtype=torch.float32, **where
            ).eval()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot load {loaded.path} as a reference: {exc}") from None
    return torch_target(
        loaded.model,
        hf=hf,
        name=model,
        eos_token_ids=loaded.eos_token_ids,
        atol=1e-3,
        rtol=1e-3,
        **executor_kwargs,
    )
