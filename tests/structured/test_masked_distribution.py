"""With sampling, a constrained request samples from the masked distribution: softmax(logits / T) over the ids
the grammar allows, renormalised (a chi-square test against the model's own logits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import byte_core
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from mechserve.api.params import SamplingParams
from mechserve.model.loader import LoadedModel

N = 3000


@pytest.mark.parametrize("temperature", [1.5, 3.0])
def test_first_token_follows_the_masked_distribution(
    byte_model: LoadedModel, byte_dir: Path, temperature: float
) -> None:
    tok = byte_model.tokenizer
    prompt = tok.encode("pick:")
    allowed = [tok.encode(c)[0] for c in "abcdefgh"]
    hf = AutoModelForCausalLM.from_pretrained(byte_dir).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits[allowed] / temperature, dim=-1)  # the masked distribution
    core = byte_core(byte_model, num_pages=N + 64, max_running=N)
    so = {"regex": "[a-h]"}
    for i in range(N):
        core.add_request(prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=2, structured_outputs=so))
    outs = core.run_until_idle()
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    assert set(firsts) <= set(allowed)
    counts = [firsts.count(t) for t in allowed]
    expected = (probs * N).tolist()
    keep = [j for j, e in enumerate(expected) if e >= 5]  # chi-square needs expected counts of 5 or more
    assert len(keep) >= 3, expected
    rest_obs = N - sum(counts[j] for j in keep)
    rest_exp = N - sum(expected[j] for j in keep)
    obs = [counts[j] for j in keep] + ([rest_obs] if rest_exp >= 5 else [])
    exp = [expected[j] for j in keep] + ([rest_exp] if rest_exp >= 5 else [])
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
    # and the unmasked distribution would put most of its mass elsewhere
    assert float(torch.softmax(logits / temperature, dim=-1)[allowed].sum()) < 0.5
