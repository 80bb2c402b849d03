"""End to end on SmolLM2-135M-Instruct: the server's chat uses the model's chat template, usage agrees with the
returned text, greedy completions equal ``LLM.generate``, and a real long prefill never stalls the event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from server_support import serving

from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.entrypoints.llm import LLM

pytestmark = pytest.mark.e2e
NAME = "smollm2"
PROMPTS = ["def fibonacci(n):\n    ", "Check marks: ✓ ✓ and crosses: ✗"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def solo(smollm2: Any) -> LLM:
    """The same weights under the offline API: the reference for "the same request run alone"."""
    return LLM(smollm2, num_pages=64)


@pytest.fixture(scope="module")
def served(smollm2: Any) -> Any:
    with serving(AsyncLLM(smollm2, num_pages=256, max_step_tokens=512, model_name=NAME)) as served:
        yield served


def test_chat_uses_the_chat_template_and_usage_agrees_with_the_text(served, solo, smollm2) -> None:
    out = served.client().chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    (ref,) = solo.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    done = ref.outputs[0]
    assert ref.prompt.startswith("<|im_start|>") and "<|im_start|>assistant\n" in ref.prompt
    choice = out.choices[0]
    assert choice.message.content == done.text and choice.finish_reason == done.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(done.token_ids)
    assert smollm2.tokenizer.decode(done.token_ids, skip_special_tokens=True) == choice.message.content
    streamed = served.client().chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == done.text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_equal_llm_generate(served, solo, smollm2, prompt: str) -> None:
    (ref,) = solo.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    done = ref.outputs[0]
    client = served.client()
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == done.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) == len(smollm2.tokenizer(prompt).input_ids)
    assert out.usage.completion_tokens == len(done.token_ids)
    chunks = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == done.text


def test_a_real_long_prefill_never_stalls_the_event_loop(smollm2) -> None:
    prompt = "The history of the river and the city around it is long. " * 48  # about 600 tokens
    gaps: list[float] = []

    async def main() -> float:
        async with AsyncLLM(smollm2, num_pages=128, max_step_tokens=2048) as llm:
            stop = asyncio.Event()

            async def ticker() -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    await asyncio.sleep(0.01)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            task = asyncio.ensure_future(ticker())
            started = time.perf_counter()
            out = await llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
            elapsed = time.perf_counter() - started
            stop.set()
            await task
            assert len(out.prompt_token_ids) > 500
            return elapsed

    elapsed = asyncio.run(main())
    assert len(gaps) >= elapsed / 0.05, f"{len(gaps)} ticks in {elapsed:.2f} s"
    # Relative, not a wall-clock bound (the machine is shared): a loop blocked by the forward would
    # stall for about the whole prefill; a scheduling hiccup under load is a fraction of it.
    assert max(gaps) < elapsed / 2, f"the event loop stalled for {max(gaps):.3f} s during a {elapsed:.2f} s prefill"
