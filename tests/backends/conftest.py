"""Tiny random-weight Llama-family checkpoints built in the test session, and HF reference helpers."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from mechserve.backends.llama import LlamaModel
from mechserve.backends.models import load_model

VOCAB = 128


def tiny_config(model_type: str = "llama", **overrides: Any) -> Any:
    """A 2-layer, hidden-64, 4-head / 2-KV-head config; large init so greedy choices are not near ties."""
    from transformers import AutoConfig

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
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
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def save_tiny(path: Path, config: Any, seed: int = 0) -> Any:
    """Build a random-weight causal LM for ``config``, save it to ``path`` and return it (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    hf.save_pretrained(path)
    return hf


@dataclass
class Tiny:
    path: Path
    hf: Any
    model: LlamaModel


def build_tiny(path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Tiny:
    hf = save_tiny(path, tiny_config(model_type, **overrides), seed)
    return Tiny(path, hf, load_model(str(path), tokenizer=False).model)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The default tiny Llama (untied head)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"))


def hf_greedy(hf: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """transformers' own greedy continuation of one prompt (batch 1, no padding)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
