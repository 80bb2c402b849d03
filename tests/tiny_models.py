"""The tiny random-weight models every torch test builds: one config, one saver, one word tokenizer.

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject.toml), so test folders import this as
``tiny_models``.  The word tokenizer maps ``w0`` .. ``w127`` to ids 0 .. 127.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def tiny_config(model_type: str = "llama", **overrides: Any) -> Any:
    """A 2-layer, hidden-64, 4-head / 2-KV-head config; large init so greedy choices are not near ties."""
    from transformers import AutoConfig

    from mechserve.conformance.target import TINY_CONFIG

    fields: dict[str, Any] = {**TINY_CONFIG, "vocab_size": VOCAB}
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def save_tiny(path: Path, config: Any, seed: int = 0) -> Any:
    """Build a random-weight causal LM for ``config``, save it to ``path`` and return it (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    hf.save_pretrained(path)
    return hf


def save_word_tokenizer(path: Path) -> None:
    """Save the word-level tokenizer (``w<id>``, whitespace-split) with ``CHAT_TEMPLATE`` next to a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


# Byte-level pieces merged into single tokens, so JSON has several spellings (drafts, rollback).
BYTE_MERGES = ('"', ":"), ("{", '"'), (",", '"'), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("Ġ", '"')
BYTE_VOCAB = 272  # 1 EOS + 256 bytes + the merges, padded to an even width


def save_byte_tokenizer(path: Path) -> Any:
    """Save a byte-level BPE tokenizer (GPT-2's byte alphabet, a few JSON merges, EOS ``<|endoftext|>`` = 0)
    next to a model of vocabulary ``BYTE_VOCAB``: any text is a token string, as structured outputs need."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in BYTE_MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) <= BYTE_VOCAB
    tok = Tokenizer(models.BPE(vocab, list(BYTE_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


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


def words(ids: Sequence[int]) -> str:
    """The word tokenizer's text for ``ids`` (``w3 w14 ...``)."""
    return " ".join(f"w{i}" for i in ids)


def random_prompts(lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    """Seeded random prompts of the given lengths over the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def save_successor_model(
    path: Path,
    successor: Mapping[int, int],
    vocab: int = 16,
    *,
    eos_token_id: int | None = None,
    max_position_embeddings: int | None = None,
) -> None:
    """Save a real 1-layer Llama whose greedy choice after token ``i`` is ``successor[i]`` (else ``i`` itself).

    One-hot embeddings (hidden = vocabulary), attention and MLP outputs of zero, and a head that maps
    ``e_i`` to ``e_successor(i)``.  ``eos_token_id`` goes into its config and generation config (the engine
    then ends on it)."""
    from transformers import AutoModelForCausalLM

    extra = {} if max_position_embeddings is None else {"max_position_embeddings": max_position_embeddings}
    config = tiny_config(
        vocab_size=vocab,
        hidden_size=vocab,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )
    config.eos_token_id = eos_token_id
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(torch.eye(vocab))
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.layers[0].mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, vocab)
        for i in range(vocab):
            head[successor.get(i, i), i] = 1.0
        hf.lm_head.weight.copy_(head)
    hf.generation_config.eos_token_id = eos_token_id
    hf.save_pretrained(path)


def save_cycle_model(path: Path, cycle: Sequence[int], vocab: int = 16, eos_token_id: int | None = None) -> None:
    """``save_successor_model`` for a cycle (``cycle[i]`` -> ``cycle[i + 1]``, cyclically), with the word
    tokenizer (``w<id>``) beside it so that ``mechserve generate`` can run it."""
    save_successor_model(path, dict(zip(cycle, [*cycle[1:], cycle[0]])), vocab, eos_token_id=eos_token_id)
    save_word_tokenizer(path)
