"""``EngineConfig.device``: one device parameter places the weights, the KV pool and each step's tensors.

On this CPU-only machine the CUDA path itself cannot run; what is checked here is that every tensor
the engine allocates follows the one parameter (a fake device routed through ``torch_device``:
``meta``, which refuses to mix with host tensors in most ops), that the native kernels stay off a
non-CPU device, and that a device that is not there is one clear error.  ``test_gpu.py`` runs the
same engine on a real GPU (``gpu`` marker).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_runs import run_engine
from tiny_checkpoints import Tiny, hf_greedy, random_prompts

from mechserve.api.config import EngineConfig
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.kv import native
from mechserve.model.llama import LayerWeights, LlamaModel
from mechserve.model.loader import torch_device


def model_tensors(model: LlamaModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a ``LlamaModel`` holds, by name."""
    yield from (("embed", model.embed), ("lm_head", model.lm_head), ("norm", model.norm), ("rope", model.inv_freq))
    for i, w in enumerate(model.layers):
        for f in fields(LayerWeights):
            t = getattr(w, f.name)
            if t is not None:
                yield f"layer {i} {f.name}", t


def engine_tensors(core: EngineCore) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model_tensors(core.executor.model)  # type: ignore[attr-defined]
    cache = core.executor.cache  # type: ignore[attr-defined]
    yield from (("cache k", cache.k), ("cache v", cache.v), ("workspace k", cache._ws_k), ("workspace v", cache._ws_v))


def test_device_names_are_checked_for_their_form() -> None:
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device=" CUDA:1 ").device == "cuda:1"
    assert EngineConfig(device=torch.device("cuda", 0)).device == "cuda:0"
    for bad in ("gpu", "cuda:x", "cuda:", "cpu:0", "", 3, None):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            EngineConfig(device=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size > 1"):
        EngineConfig(device="cuda", world_size=2)
    with pytest.raises(ValueError, match="compile must be True or False"):
        EngineConfig(compile="yes")  # type: ignore[arg-type]
    assert EngineConfig.from_args(device="cuda", compile=True).compile


def test_a_device_that_is_not_there_is_one_error_naming_it(tiny: Tiny) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    loaded = SimpleNamespace(model=tiny.model, tokenizer=None, eos_token_ids=())
    with pytest.raises(ValueError, match=f"device '{missing}' is not available"):
        EngineCore(loaded, EngineConfig(device=missing, num_pages=8))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda' is not available: torch.cuda.is_available\(\) is False"):
            torch_device("cuda")
    assert torch_device("cpu") == torch.device("cpu")


def test_an_explicit_cpu_device_keeps_everything_on_the_host_and_matches_transformers(tiny: Tiny) -> None:
    prompts = random_prompts([5, 17, 9], seed=3)
    run = run_engine(tiny.model, prompts, 8, config=EngineConfig(device="cpu", page_size=4))
    for prompt, done in zip(prompts, run.completions):
        assert list(done.token_ids) == hf_greedy(tiny.hf, prompt, 8)
    assert run.core.executor.model is tiny.model  # type: ignore[attr-defined]  # nothing was copied
    assert {name: t.device.type for name, t in engine_tensors(run.core)} == {
        name: "cpu" for name, _ in engine_tensors(run.core)
    }


@pytest.fixture
def meta_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cuda"`` resolved to the meta device: every tensor placed by the device parameter is
    meta, anything created on the host by mistake meets it in an op and fails."""
    import mechserve.model.loader as loader

    real = loader.torch_device
    monkeypatch.setattr(loader, "torch_device", lambda d: torch.device("meta") if d == "cuda" else real(d))


def test_every_allocation_follows_the_one_device_parameter(tiny: Tiny, meta_for_cuda: None, monkeypatch) -> None:
    def no_native(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the native kernel reads host memory; it must not run on another device")

    monkeypatch.setattr(native, "paged_attention", no_native)
    loaded = SimpleNamespace(model=tiny.model, tokenizer=None, eos_token_ids=())
    core = EngineCore(loaded, EngineConfig(device="cuda", num_pages=16, page_size=4, check_memory=False))
    placed = {name: t.device.type for name, t in engine_tensors(core)}
    assert placed == dict.fromkeys(placed, "meta")
    assert all(t.device.type == "cpu" for _, t in model_tensors(tiny.model))  # the caller's model is untouched

    model = core.executor.model  # type: ignore[attr-defined]
    forward = model.forward
    seen: list[torch.device] = []

    def spy(input_ids: torch.Tensor, positions: torch.Tensor, cache: Any, batch: Any, rows: Any = None) -> Any:
        logits = forward(input_ids, positions, cache, batch, rows)  # runs on meta: a host tensor inside would fail
        seen.append(logits.device)
        n = logits.shape[0]
        return torch.zeros(n, logits.shape[1]).index_fill_(1, torch.tensor([7]), 1.0)  # host ids to go on with

    monkeypatch.setattr(model, "forward", spy)
    (prompt,) = random_prompts([9], seed=4)
    core.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), request_id="a")
    (done,) = core.run_until_idle()
    assert list(done.outputs[0].token_ids) == [7, 7, 7, 7]
    assert len(seen) == 4 and all(d.type == "meta" for d in seen)  # a prefill, then three decode steps


def test_compile_flag_reaches_the_model(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=True`` swaps in the compiled blocks (their identity with eager is test_compile.py's, slow)."""
    import mechserve.model.llama as llama

    marker = (lambda *a: None, lambda *a: None)
    monkeypatch.setattr(llama, "_compiled_blocks", lambda: marker)
    loaded = SimpleNamespace(model=tiny.model, tokenizer=None, eos_token_ids=())
    core = EngineCore(loaded, EngineConfig(compile=True, num_pages=8))
    assert core.executor.model._blocks is marker  # type: ignore[attr-defined]
    assert tiny.model._blocks == (llama.attention_inputs, llama.attention_outputs)
