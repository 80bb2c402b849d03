"""A tiny random Llama whose tokenizer can spell anything: byte-level, one id per byte (no merges).

The serving tests' word tokenizer (``w0`` .. ``w127``) has no ``{`` or ``"``, so no JSON tool call can
be written with it; this one has the 256 bytes (ids 0..255) and ChatML's two special tokens
(``<|im_start|>`` 256, ``<|im_end|>`` 257, the EOS), and SmolLM2's ChatML template, which renders no
tools (so the server uses its shipped tools template for this model, as it does for SmolLM2).  Its context
is 4096 positions: at a byte per token a prompt with two tools is some 900 ids.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import save_tiny, tiny_config

# SmolLM2-135M-Instruct's own template, without its default system prompt: ChatML, no tools.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BYTE_VOCAB = 258
EOS = 257


def _byte(char: str) -> int:
    """The byte GPT-2's byte-level alphabet spells with ``char``."""
    code = ord(char)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def save_byte_model(path: Path, seed: int = 0) -> Path:
    """Save the tiny byte-level model (random weights, ``seed``) with its tokenizer and ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters GPT-2's byte-level BPE spells bytes with
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(chars, key=_byte))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = CHATML
    assert fast.convert_tokens_to_ids("<|im_end|>") == EOS, "the special tokens follow the 256 bytes"
    fast.save_pretrained(path)
    save_tiny(
        path,
        tiny_config(vocab_size=BYTE_VOCAB, eos_token_id=EOS, bos_token_id=256, max_position_embeddings=4096),
        seed=seed,
    )
    return path
