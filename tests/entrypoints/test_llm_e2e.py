"""End to end on SmolLM2-135M: ``LLM`` / ``EngineCore`` greedy ids equal transformers' ``generate``, under many
engine configurations; chat; SmolLM2's multi-byte tokens through the detokenizer; the README's Python example.

transformers' reference is computed once per prompt (batch 1, float32, the same converted weights) together
with its logits, so that a mismatch is reported with the first differing position and transformers' top-2
logit gap there: a near-tie is named as one, and still fails.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mechserve.api.config import EngineConfig
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.engine.detokenizer import IncrementalDetokenizer
from mechserve.entrypoints.llm import LLM
from mechserve.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.e2e

NEW = 16
NEAR_TIE = 1e-3  # a top-2 logit gap below this is a near-tie
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are red, yellow and",
    "Translate to French: 'Good morning, my friend.' ->",
    "1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nName one planet of the solar system.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. " * 5 + "The quick",
]
SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. You answer in one short sentence, you never invent facts, "
    "and when a question is ambiguous you say which reading you chose. You write numbers as digits and you "
    "spell out units. You do not use lists or headings. If you do not know the answer, you say so plainly and "
    "stop. These instructions hold for the whole conversation, whatever the user asks later.<|im_end|>\n"
)
SHARED = [SYSTEM + p for p in PROMPTS[:4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    ids: list[int]
    gaps: list[float]  # transformers' top-2 logit gap at each output position


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def reference(smollm2: LoadedModel) -> dict[str, Reference]:
    """transformers' greedy continuation of every prompt (batch 1, fp32), with its logits' top-2 gaps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()
    refs = {}
    for prompt in PROMPTS + SHARED:
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gaps = [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in out.logits)]
        refs[prompt] = Reference(ids[0].tolist(), out.sequences[0, ids.shape[1] :].tolist(), gaps)
    return refs


def mismatches(
    name: str, prompts: Sequence[str], got: Sequence[Sequence[int]], refs: dict[str, Reference]
) -> list[str]:
    """One line per prompt whose ids differ: the first differing position and transformers' top-2 gap there."""
    lines = []
    for prompt, ids in zip(prompts, got):
        want = refs[prompt].ids
        if list(ids) == want:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        ours = ids[i] if i < len(ids) else "end"
        theirs = want[i] if i < len(want) else "end"
        gap = refs[prompt].gaps[i] if i < len(refs[prompt].gaps) else float("nan")
        tie = " -- a NEAR-TIE" if gap < NEAR_TIE else ""
        lines.append(
            f"[{name}] {prompt[:40]!r}: first difference at output position {i}: engine {ours}, transformers "
            f"{theirs}; transformers' top-2 logit gap there {gap:.3g}{tie}"
        )
    return lines


def generate(llm: LLM, prompts: Sequence[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), GREEDY, use_tqdm=False)]


CONFIGS = {
    "default": {},
    "tiny-budget": {"max_step_tokens": 7},
    "tiny-pool": {"page_size": 4, "num_pages": 26, "max_step_tokens": 256},
    "page-size-1": {"page_size": 1, "max_step_tokens": 256},
    "page-size-16-spec": {"page_size": 16, "max_step_tokens": 64, "spec_len": 3, "prefix_caching": False},
}


def test_greedy_ids_equal_transformers_under_every_configuration(
    smollm2: LoadedModel, reference: dict[str, Reference]
) -> None:
    failures: list[str] = []
    for name, config in CONFIGS.items():
        llm = LLM(smollm2, **config)
        failures += mismatches(name, PROMPTS, generate(llm, PROMPTS), reference)
        llm.core.check_pages()
        if name == "tiny-pool":
            assert any(r.preempted for r in llm.trace), "the tiny pool never preempted"
        if name == "tiny-budget":
            assert max(sum(r.executed.values()) for r in llm.trace) <= 7
    # prefix caching with a long shared system prompt: the first request publishes it, the others reuse it
    llm = LLM(smollm2, page_size=16)
    got = generate(llm, SHARED[:1])
    got += generate(llm, SHARED[1:])
    assert sum(sum(r.reused.values()) for r in llm.trace) >= 3 * 16 * 5
    failures += mismatches("prefix-caching", SHARED, got, reference)
    llm.core.check_pages()
    # staggered arrivals: requests join a running batch at different steps
    core = EngineCore(smollm2, EngineConfig(page_size=8, max_step_tokens=48, num_pages=200))
    ids, done = {}, {}
    for k, prompt in enumerate(PROMPTS):
        ids[core.add_request(reference[prompt].prompt_ids, GREEDY)] = prompt
        for _ in range(k % 3 + 1):
            done.update((o.request_id, o) for o in core.step().finished)
    while core.has_unfinished():
        done.update((o.request_id, o) for o in core.step().finished)
    failures += mismatches("staggered", list(ids.values()), [done[r].outputs[0].token_ids for r in ids], reference)
    core.check_pages()
    assert not failures, "greedy ids differ from transformers:\n" + "\n".join(failures)


def test_a_mismatch_names_the_position_and_the_gap() -> None:
    refs = {"p": Reference([1], [5, 6, 7], [2.0, 0.0004, 1.0])}
    (line,) = mismatches("cfg", ["p"], [[5, 9, 7]], refs)
    assert "first difference at output position 1: engine 9, transformers 6" in line
    assert "top-2 logit gap there 0.0004 -- a NEAR-TIE" in line
    assert "NEAR-TIE" not in mismatches("cfg", ["p"], [[8, 6, 7]], refs)[0]
    assert "position 3: engine 8, transformers end" in mismatches("cfg", ["p"], [[5, 6, 7, 8]], refs)[0]
    assert mismatches("cfg", ["p"], [[5, 6, 7]], refs) == []


def test_chat_answers_a_simple_question(smollm2: LoadedModel) -> None:
    llm = LLM(smollm2)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)
    answer = out.outputs[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert answer.text.strip() and answer.finish_reason in ("stop", "length")
    assert "Paris" in answer.text
    if answer.finish_reason == "stop":
        assert answer.stop_reason is None and answer.token_ids[-1] in smollm2.eos_token_ids
        assert "<|im_end|>" not in answer.text


def test_smollm2_multi_byte_tokens_are_never_split(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    text = "héllo € ✓ 日本語 — naïve café 🙂"
    ids = tok(text).input_ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some character really spans several tokens
    detok = IncrementalDetokenizer(lambda window: tok.decode(list(window)), prompt_ids=ids[:1])
    deltas = [detok.push(t) for t in ids[1:]]
    assert all("\ufffd" not in d for d in deltas)
    assert tok.decode(ids[:1]) + "".join(deltas) + detok.flush() == text


def test_readme_python_example_runs() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", readme.split("## Python API", 1)[1], re.S)
    assert block is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.group(1), "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("' Paris") and "stop '\\n\\n' TTFT" in lines[0], lines
    assert lines[1].startswith("'\\n    if n") and "TTFT" in lines[1], lines
    assert "Paris" in "\n".join(lines[2:-1]) and re.match(
        r"\d+ steps: \{'step': \d+, 'admitted': \['2'\]", lines[-1]
    ), lines
