"""The torch executor on a CUDA device (``gpu`` marker; CI deselects them with ``-m "not gpu"``).

Never run yet: written and checked on a CPU-only machine (docs/gpu.md says what is ready).  On a
machine with CUDA, ``tools/gpu_check.sh`` runs them.  They replay the CPU parity tests with every
engine on the GPU (``engine_runs.DEVICE``), run the conformance suite's replay and KV audit on a GPU
executor, and compare SmolLM2's greedy ids with transformers' ``generate`` on the same GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import engine_runs
import pytest
import torch
from engine_runs import run_engine
from tiny_checkpoints import Tiny, hf_greedy, random_prompts

from mechserve.api.config import EngineConfig
from mechserve.engine.core import EngineCore

from . import test_engine_parity as cpu_parity

pytestmark = pytest.mark.gpu
CPU_PARITY: list[Callable[[Tiny], None]] = [f for name, f in vars(cpu_parity).items() if name.startswith("test_")]


@pytest.fixture
def on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need CUDA (deselect them with -m 'not gpu')")
    monkeypatch.setattr(engine_runs, "DEVICE", "cuda")


@pytest.mark.parametrize("case", CPU_PARITY, ids=[f.__name__ for f in CPU_PARITY])
def test_cpu_parity_case_on_the_gpu(case: Callable[[Tiny], None], tiny: Tiny, on_gpu: None) -> None:
    """Each mechanism configuration of test_engine_parity.py (chunked prefill, preemption, prefix
    sharing, page size 1, speculation with oracle and wrong drafters, EOS, all at once) on CUDA."""
    case(tiny)


def test_the_engine_really_runs_on_the_gpu(tiny: Tiny, on_gpu: None) -> None:
    prompts = random_prompts([5, 17, 9, 30])
    run = run_engine(tiny.model, prompts, 12, config=EngineConfig(spec_len=2, page_size=4))
    for prompt, done in zip(prompts, run.completions):
        assert list(done.token_ids) == hf_greedy(tiny.hf, prompt, 12)
    ex: Any = run.core.executor
    assert ex.cache.k.device.type == "cuda" and ex.model.embed.device.type == "cuda"
    assert tiny.model.embed.device.type == "cpu"


def test_sampling_and_logprobs_on_the_gpu(tiny: Tiny, on_gpu: None) -> None:
    """Rows that are not plain greedy are sampled on the host (``sampling_logits``): seeded sampling with
    penalties and logprobs runs, and is reproducible."""
    from mechserve.api.params import SamplingParams

    (prompt,) = random_prompts([11], seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=2, repetition_penalty=1.2)
    loaded = SimpleNamespace(model=tiny.model, tokenizer=None, eos_token_ids=())
    outs = []
    for _ in range(2):
        core = EngineCore(loaded, EngineConfig(device="cuda", num_pages=8, page_size=4))
        core.add_request(prompt, params, request_id="s")
        (done,) = core.run_until_idle()
        assert len(done.outputs[0].logprobs or []) == 10
        outs.append(done.outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_conformance_replay_and_kv_audit_on_a_gpu_executor(on_gpu: None) -> None:
    from mechserve.conformance import tiny_model, torch_target
    from mechserve.conformance.suite import check_executor

    model, hf = tiny_model()
    target = torch_target(model.to("cuda"), hf=hf, name="tiny on cuda")
    report = check_executor(target, workloads=25, checks=("replay", "kv", "contract"), world_size=(1, 1))
    assert report.passed, report.to_json()


@pytest.mark.e2e
def test_smollm2_greedy_equals_transformers_on_the_same_gpu(on_gpu: None) -> None:
    from transformers import AutoModelForCausalLM

    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM
    from mechserve.model.checkpoint import resolve_model

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    llm = LLM("smollm2", device="cuda")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    tok = llm.core.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.float32).eval().cuda()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok(prompt).input_ids], device="cuda")
        with torch.inference_mode():
            want = hf.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
        assert list(out.outputs[0].token_ids) == want, prompt
