"""One finite greedy run of token-id prompts through ``EngineCore``: what the torch tests compare.

``run_engine(model, prompts, max_new)`` submits prompt ``i`` as request ``"r<i>"`` (greedy, ``max_new``
tokens, arriving at ``arrivals[i]``), runs the engine until it is idle and returns the step
records, one ``Completion`` per prompt (prompt order) and the scheduler's summary.  A request the
door refuses gets a completion with ``rejected`` set and no ids.  Without ``num_pages`` or
``kv_memory`` in the config, the pool holds every request at once (``auto_num_pages``), as a
batch of known prompts needs.  ``DEVICE`` (default ``"cpu"``) is the device of every engine whose
config leaves ``device`` at ``"cpu"``: the ``gpu`` tests set it to replay the CPU tests on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from mechserve.api.config import EngineConfig
from mechserve.api.errors import RequestRejected
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.engine.pool import auto_num_pages, model_context
from mechserve.spec import m16_request_draft_lengths as m16

# Where run_engine's engines run: the gpu tests set this to "cuda" to replay the CPU tests there.
DEVICE = "cpu"


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's result: its generated ids (an ending EOS id included), the scheduler's finish reason
    (``"LENGTH"``, ``"EOS"``, ``"STOP"``) and, for a refused request, the door's reason."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str | None
    rejected: str | None = None
    text: str = ""


@dataclass(frozen=True, slots=True)
class Run:
    """A finished run: its step records, one completion per prompt, the summary and the core."""

    records: list[m16.StepRecord]
    completions: list[Completion]
    summary: list[dict[str, Any]]
    num_pages: int
    core: EngineCore


def run_engine(
    model: Any,
    prompts: Sequence[Sequence[int] | str],
    max_new_tokens: int,
    *,
    config: EngineConfig | None = None,
    eos_token_ids: Sequence[int] = (),
    arrivals: Sequence[int] | None = None,
    executor: Any = None,
    proposer: Any = None,
    tokenizer: Any = None,
) -> Run:
    """Run ``prompts`` greedily on ``model`` (a ``LlamaModel``) to the end; see the module docstring.

    ``proposer`` (a ``(history, num) -> ids`` function) drafts the guesses instead of prompt lookup;
    ``executor`` replaces the engine's own (over the same pool size); with ``tokenizer``, prompts may be
    text and completions carry their text."""
    prompts = [list(tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in prompts]
    config = config or EngineConfig()
    if DEVICE != "cpu" and config.device == "cpu":
        config = replace(config, device=DEVICE)
    if config.num_pages is None and config.kv_memory is None:
        lens = [len(p) for p in prompts] or [1]
        pages = auto_num_pages(
            lens,
            max_new_tokens,
            config.page_size,
            model,
            config.max_kv_bytes,
            config.max_model_len or model_context(model),
        )
        config = replace(config, num_pages=pages)
    if proposer is not None:
        from mechserve.executor.torch_executor import TorchExecutor

        executor = TorchExecutor(
            model.to(config.device),
            config.num_pages,
            config.page_size,
            proposer=proposer,
            speculative=config.speculative_config(),
        )
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, eos_token_ids=tuple(eos_token_ids), path=None)
    core = EngineCore(loaded, config, keep_finished=True, executor=executor)
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    rejected: dict[str, str] = {}
    for i, (ids, step) in enumerate(zip(prompts, arrivals)):
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        try:
            core.add_request(list(ids), params, request_id=f"r{i}", arrival_step=step)
        except RequestRejected as exc:
            rejected[f"r{i}"] = exc.reason.value
    records: list[m16.StepRecord] = []
    outputs = {o.request_id: o for o in core.run_until_idle(lambda out: records.append(out.record))}
    summary = core.summary()
    reasons = {e["request_id"]: e["finish_reason"] for e in summary}
    completions = []
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        done = outputs.get(rid)
        token_ids = tuple(done.outputs[0].token_ids) if done is not None else ()
        text = done.outputs[0].text if done is not None else ""
        completions.append(Completion(rid, tuple(ids), token_ids, reasons.get(rid), rejected.get(rid), text))
    return Run(records, completions, summary, core.num_pages, core)


__all__ = ["Completion", "Run", "run_engine"]
