"""Output caching (m13) in the product: a conversation's next turn reuses its answer; greedy ids do not change.

``EngineConfig.output_caching`` is on by default.  Turn 2 of a chat through ``LLM.chat`` then reuses
the blocks of turn 1's answer (``reused`` in its step record); with it off only turn 1's prompt
blocks are reused.  Either way every output is token for token the same (the tiny random Llama,
greedy), also under speculation, preemption and several samples per prompt.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_runs import run_engine
from tiny_engines import random_prompts, words

from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.llm import LLM

PAGE = 4
# The assistant's turn is rendered as the generation prompt (w3) then its text, as real chat templates do,
# so turn 2's prompt repeats turn 1's prompt and answer token for token.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w3 {{ m['content'] }} w2 "
    "{% else %}w1 {{ m['content'] }} w2 {% endif %}{% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=9)


def two_turns(llm: LLM) -> tuple[Any, Any, Any]:
    """Turn 1, then turn 2 = turn 1 + its answer + a new message; (turn 1's output, turn 2's, turn 2's trace)."""
    first = [{"role": "user", "content": words([5, 6, 7, 8, 9, 10, 11])}]
    (one,) = llm.chat(first, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    second = [*first, {"role": "assistant", "content": one.outputs[0].text}, {"role": "user", "content": "w12 w13"}]
    (two,) = llm.chat(second, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    return one, two, llm.trace


@pytest.mark.parametrize("on", [True, False])
def test_turn_two_reuses_turn_ones_answer_blocks(tiny: Any, on: bool) -> None:
    llm = LLM(tiny, page_size=PAGE, num_pages=64, max_step_tokens=32, trace=True, output_caching=on)
    assert llm.core.config.output_caching is on
    one, two, trace = two_turns(llm)
    p1, answer = one.prompt_token_ids, one.outputs[0].token_ids
    assert two.prompt_token_ids[: len(p1) + len(answer)] == p1 + answer  # the answer re-tokenizes to its ids
    turn2 = two.request_id
    reused = sum(rec.reused.get(turn2, 0) for rec in trace)
    computed = len(p1) + len(answer) - 1  # turn 1's last id is sampled, never computed
    assert reused == (computed // PAGE if on else len(p1) // PAGE) * PAGE
    prefill = sum(rec.executed.get(turn2, 0) for rec in trace if turn2 not in rec.tokens) + trace_first(trace, turn2)
    assert prefill == len(two.prompt_token_ids) - reused
    llm.core.check_pages()


def trace_first(trace: list[Any], rid: str) -> int:
    """The tokens computed in the step that sampled ``rid``'s first id."""
    return next(rec.executed[rid] for rec in trace if rid in rec.tokens)


def test_the_default_is_on_and_the_ids_do_not_change(tiny: Any) -> None:
    assert EngineConfig().output_caching is True
    assert LLM(tiny, num_pages=32).core.scheduler.spec_engine.output_caching is True
    outs = []
    for on in (True, False):
        llm = LLM(tiny, page_size=PAGE, num_pages=64, max_step_tokens=32, output_caching=on)
        one, two, _ = two_turns(llm)
        outs.append((one.outputs[0].token_ids, two.outputs[0].token_ids))
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="output_caching must be True or False"):
        EngineConfig(output_caching=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(page_size=4, max_step_tokens=64),
        EngineConfig(page_size=2, max_step_tokens=5, num_pages=20),  # chunked prefill, a tight pool: preemption
        EngineConfig(page_size=4, speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False)),
        EngineConfig(page_size=1, max_step_tokens=7, num_pages=40, spec_len=2),
    ],
    ids=["plain", "tight-chunked", "speculative", "page-1"],
)
def test_greedy_ids_are_the_same_with_output_caching_on_and_off(tiny: Any, config: EngineConfig) -> None:
    """Next turns that repeat first turns' answers arrive while other requests run; every id is the same
    on and off, and on reuses more (the answers)."""
    firsts = random_prompts([7, 12, 5], seed=61)
    base = run_engine(tiny.model, firsts, 8, config=config.replace(output_caching=False)).completions
    turns = [[*c.prompt_ids, *c.token_ids[:-1], 9, 10] for c in base]
    prompts = [*firsts, *turns, *firsts[:1]]  # the same first prompt twice: twins adopt generated blocks
    arrivals = [0, 0, 1, 30, 31, 32, 40]
    got = {}
    reused: dict[bool, dict[str, int]] = {}
    for on in (True, False):
        run = run_engine(tiny.model, prompts, 8, config=config.replace(output_caching=on), arrivals=arrivals)
        got[on] = [c.token_ids for c in run.completions]
        reused[on] = {}
        for rec in run.records:  # each next turn's first hit (a preempted request may hit again later)
            for rid, n in rec.reused.items():
                reused[on].setdefault(rid, n)
        run.core.check_pages()
    assert got[True] == got[False]
    assert got[True][:3] == [c.token_ids for c in base]
    turns_on = [reused[True].get(f"r{i}", 0) for i in (3, 4, 5)]
    turns_off = [reused[False].get(f"r{i}", 0) for i in (3, 4, 5)]
    assert all(a >= b for a, b in zip(turns_on, turns_off)) and turns_on != turns_off, (turns_on, turns_off)


def test_several_samples_publish_their_own_answers(tiny: Any) -> None:
    """``n = 3`` seeded samples of one prompt: three answers, three branches in the cache; a next turn on
    sample 1's answer reuses sample 1's blocks, not another's."""
    llm = LLM(tiny, page_size=PAGE, num_pages=64, max_step_tokens=32, trace=True)
    prompt = random_prompts([6], seed=3)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8), use_tqdm=False)
    answers = [c.token_ids for c in out.outputs]
    assert len({tuple(a) for a in answers}) == 3
    follow = [*prompt, *answers[1][:-1], 9]
    (next_turn,) = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    reused = sum(rec.reused.get(next_turn.request_id, 0) for rec in llm.trace)
    assert reused == (len(prompt) + len(answers[1]) - 1) // PAGE * PAGE
    llm.core.check_pages()
