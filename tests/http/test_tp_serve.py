"""The server over tensor-parallel ranks: ``AsyncLLM(world_size=2)`` answers as one process does."""

from __future__ import annotations

import pytest
from server_support import serving

pytestmark = pytest.mark.slow


def test_completions_over_two_ranks_match_the_one_process_reference(make_llm, reference) -> None:
    prompt = "w3 w14 w15 w92 w65"
    llm = make_llm(world_size=2)
    with serving(llm) as served:
        reply = served.client().completions.create(
            model=served.llm.model_name, prompt=prompt, max_tokens=6, temperature=0
        )
        served.wait_idle()
    assert reply.choices[0].text == reference(prompt, max_tokens=6).outputs[0].text
    assert llm.core.executor is not None and llm.core.executor.closed  # shutdown stopped the ranks
