"""The offline Python API, as in vLLM: ``LLM(model=...)``, ``llm.generate(prompts, params)``, ``llm.chat(messages)``.

Every request runs under the top rung of the ladder (m12) through one
long-lived ``EngineCore``; ``llm.trace`` holds the step records the spec
prints::

    >>> from mechserve import LLM, SamplingParams
    >>> llm = LLM("smollm2")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text, out[0].outputs[0].finish_reason
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mechserve.backends.engine import DEFAULT_MAX_STEP_TOKENS, EngineConfig, configure_threads
from mechserve.backends.models import EMBEDDED, LoadedModel, load_model
from mechserve.backends.speculative import SpeculativeConfig
from mechserve.engine_core import EngineCore, KVMemoryError, RequestRejected
from mechserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mechserve.params import SamplingParams
from mechserve.spec.m12_admission_control import StepRecord

__all__ = [
    "LLM",
    "CompletionOutput",
    "KVMemoryError",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestsRejected",
    "SamplingParams",
    "SpeculativeConfig",
]

DTYPES = {
    "auto": torch.float32,  # on a CPU, float32 (the mode checked against transformers)
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

Prompt = str | Sequence[int] | Mapping[str, Any]


class RequestsRejected(ValueError):
    """Some prompts of one ``generate``/``chat`` call were rejected at submission; the others completed.

    ``errors`` maps each rejected prompt's index to its ``ValueError`` (a
    ``RequestRejected`` when m12's door refused it); ``outputs`` is the call's
    result in input order, None at the rejected indices.
    """

    def __init__(self, errors: dict[int, ValueError], outputs: list[RequestOutput | None]) -> None:
        lines = "; ".join(f"prompt {i}: {exc}" for i, exc in errors.items())
        ran = len(outputs) - len(errors)
        super().__init__(
            f"{len(errors)} of {len(outputs)} prompt(s) rejected at submission ({lines}); "
            f"the other {ran} ran to completion (their outputs are in .outputs)"
        )
        self.errors = errors
        self.outputs = outputs


class LLM:
    """A model served by the m12 engine on a paged KV cache, for offline batches.

    ``model``: ``"smollm2"`` (the embedded SmolLM2-135M-Instruct), a local
    Hugging Face directory, or an already loaded ``LoadedModel``.
    ``dtype``: ``"float32"`` (default; ``"auto"`` means it on a CPU),
    ``"bfloat16"`` or ``"float16"`` (weights, activations and KV cache).
    Engine sizes: ``max_step_tokens`` (per-step token budget, the prefill
    chunk), ``page_size`` (positions per KV page), ``num_pages`` (the pool)
    or ``kv_memory`` (a KV budget in bytes that sizes it; default: automatic,
    see ``mechserve.backends.engine.size_pool``), ``prefix_caching``,
    ``hold_shared_prefix`` (with prefix caching, a request waits until the
    prompt prefix it shares with a running request is cached, so the shared
    part is computed once; see ``EngineConfig``), ``spec_len`` (prompt-lookup guesses per decode step), ``max_running``,
    ``max_model_len`` (default: the model's context).  ``seed`` seeds the
    generator unseeded sampling requests share.  ``speculative_config``: a
    ``SpeculativeConfig`` (or a dict of its fields, vLLM's names
    ``prompt_lookup_min``/``prompt_lookup_max``/``model`` accepted), e.g.
    ``SpeculativeConfig(method="draft", num_speculative_tokens=4,
    draft_model="smollm2:layers=4")``; it sets ``spec_len``.  ``world_size``:
    tensor-parallel ranks, each a process holding its shard of the weights and
    KV pages (``mechserve.backends.rank_group``); ``close()`` (or ``with
    LLM(...) as llm``) stops them, and they are stopped at exit anyway.

    ``llm.trace`` is the list of m12 ``StepRecord``s of the most recent
    ``generate``/``chat`` call; with ``trace=True`` it keeps the records of
    every call since construction instead (it then grows without bound).

    Raises ``ModelLoadError`` for a model that cannot be loaded,
    ``ValueError`` for a bad size or dtype, ``KVMemoryError`` when the KV
    cache does not fit.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel = EMBEDDED,
        *,
        dtype: str | torch.dtype = "float32",
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory: int | None = None,
        prefix_caching: bool = True,
        hold_shared_prefix: bool = True,
        spec_len: int = 0,
        max_running: int | None = None,
        max_model_len: int | None = None,
        seed: int | None = 0,
        trace: bool = False,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
        world_size: int = 1,
    ) -> None:
        config = EngineConfig(
            max_step_tokens=max_step_tokens,
            page_size=page_size,
            num_pages=num_pages,
            spec_len=spec_len,
            kv_memory=kv_memory,
            max_model_len=max_model_len,
            prefix_caching=prefix_caching,
            hold_shared_prefix=hold_shared_prefix,
            max_running=max_running,
            speculative=speculative(speculative_config),
            world_size=world_size,
        )
        self.loaded, self.core = open_engine(model, dtype, config, seed)
        self.keep_all_records = trace
        self.trace: list[StepRecord] = []

    def close(self) -> None:
        """Stop the rank processes (``world_size > 1``; nothing otherwise)."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for a model loaded without one)."""
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; return one ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, a list of strings, one prompt as token ids
        (a list of ints), a list of such lists, or vLLM-style dicts
        (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``).
        ``sampling_params``: one for all, one per prompt, or None (vLLM's
        defaults: temperature 1.0, max_tokens 16).  ``use_tqdm`` shows a
        progress bar (requests done, output tokens/s) on stderr.

        A prompt that cannot be served (empty, a token id outside the
        vocabulary, a stop token id outside it, too long for the model, never
        fitting the KV pool) is rejected when it is submitted; the others run
        to completion, then ``RequestsRejected`` (a ``ValueError`` that
        carries their outputs) is raised.  Raises ``ValueError`` at once for a
        prompt of the wrong type, text without a tokenizer, or a params list
        of the wrong length.
        """
        items = [_prompt(p, self.core.tokenizer) for p in _prompt_list(prompts)]
        return self._run(items, _params_list(sampling_params, len(items)), use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Each conversation goes through the tokenizer's chat template
        (``apply_chat_template``, or ``chat_template`` if given) with
        ``add_generation_prompt``; the templated text is the output's
        ``prompt``.  Otherwise as ``generate``.  Raises ``ValueError`` if
        the tokenizer has no chat template.
        """
        tok = self.core.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this model was loaded without one")
        conversations: list[Any] = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        items: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            text = apply_chat_template(tok, conversation, add_generation_prompt, chat_template)
            items.append((text, list(tok(text, add_special_tokens=False).input_ids)))
        return self._run(items, _params_list(sampling_params, len(items)), use_tqdm)

    def _run(
        self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Submit ``items``, step until the engine is idle, return the outputs in input order."""
        self.core.engine.drop_finished()  # the previous call's requests: returned already, let them go
        request_ids: list[str | None] = []
        errors: dict[int, ValueError] = {}
        for i, ((text, ids), p) in enumerate(zip(items, params)):
            try:
                request_ids.append(self.core.add_request(ids, p, prompt=text))
            except ValueError as exc:
                request_ids.append(None)
                errors[i] = exc
        mine = {rid for rid in request_ids if rid is not None}
        done: dict[str, RequestOutput] = {}
        records: list[StepRecord] = []
        try:
            with _progress(use_tqdm, len(mine)) as advance:
                while self.core.has_unfinished():
                    out = self.core.step()
                    records.append(out.record)
                    finished = [o for o in out.finished if o.request_id in mine]
                    done.update((o.request_id, o) for o in finished)
                    advance(len(finished), sum(len(d.token_ids) for d in out.deltas))
        except BaseException:
            for rid in mine - done.keys():
                self.core.abort(rid)
            raise
        finally:
            self.trace = self.trace + records if self.keep_all_records else records
        outputs = [done[rid] if rid is not None else None for rid in request_ids]
        if errors:
            raise RequestsRejected(errors, outputs) from next(iter(errors.values()))
        return [o for o in outputs if o is not None]


def open_engine(
    model: str | os.PathLike[str] | LoadedModel, dtype: str | torch.dtype, config: EngineConfig, seed: int | None
) -> tuple[LoadedModel, EngineCore]:
    """Load ``model`` (unless already loaded) and build its ``EngineCore``: what ``LLM`` and ``AsyncLLM`` share.

    With ``config.world_size > 1`` the driver loads no weights (the rank processes load their shards).
    Raises what ``load_model`` and ``EngineCore`` raise (``ModelLoadError``, ``ValueError``, ``KVMemoryError``).
    """
    configure_threads()
    loaded = (
        model
        if isinstance(model, LoadedModel)
        else load_model(os.fspath(model), dtype=torch_dtype(dtype), weights=config.world_size == 1)
    )
    return loaded, EngineCore(loaded, config, seed=seed)


_VLLM_NAMES = {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max", "model": "draft_model"}


def speculative(config: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from itself or a dict of its fields (vLLM's names too; a dict with a draft
    model and no method means ``"draft"``).  Raises ``ValueError`` for an unknown field or a bad value."""
    if config is None or isinstance(config, SpeculativeConfig):
        return config
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(config).__name__}")
    fields = {_VLLM_NAMES.get(k, k): v for k, v in config.items()}
    unknown = sorted(set(fields) - set(SpeculativeConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
    if fields.get("draft_model") and "method" not in fields:
        fields["method"] = "draft"
    return SpeculativeConfig(**fields)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``, ``"bfloat16"``, ``"float16"`` (and their short names, ``"auto"``) or a torch dtype.

    Raises ``ValueError`` for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


def apply_chat_template(
    tokenizer: Any, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool, template: str | None
) -> str:
    """The conversation as the model's prompt text; ``ValueError`` if the tokenizer has no chat template."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
    kwargs = {"chat_template": template} if template is not None else {}
    text = tokenizer.apply_chat_template(
        list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return str(text)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or many, as a list: a string or a list of ints or a dict is one prompt."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(_is_int(t) for t in items):
        return [items]
    return items


def _prompt(prompt: Prompt, tokenizer: Any) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt; ``ValueError`` for a wrong type or text without a tokenizer."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return _prompt(str(prompt["prompt"]), tokenizer)
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model was loaded without one (give token ids)")
        return prompt, list(tokenizer(prompt).input_ids)
    return None, _ids(prompt)


def _ids(value: object) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not all(_is_int(t) for t in value):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(value).__name__}")
    return list(value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt; ``ValueError`` for a list of another length, ``TypeError`` for
    anything that is not ``SamplingParams`` (a string is not a sequence of them)."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
    found = list(params)
    wrong = next((p for p in found if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got a {type(wrong).__name__} in it")
    if len(found) != count:
        raise ValueError(f"{len(found)} SamplingParams for {count} prompt(s); give one, or one per prompt")
    return found


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """A rich progress bar on stderr (requests done, output tokens/s); yields ``advance(requests, tokens)``."""
    if not enabled or total == 0:
        yield lambda requests, tokens: None
        return
    started, produced = time.perf_counter(), 0
    columns = (
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests · {task.fields[speed]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("generate", total=total, speed="0.0 output tok/s")

        def advance(requests: int, tokens: int) -> None:
            nonlocal produced
            produced += tokens
            speed = produced / max(time.perf_counter() - started, 1e-9)
            bar.update(task, advance=requests, speed=f"{speed:.1f} output tok/s")

        yield advance
