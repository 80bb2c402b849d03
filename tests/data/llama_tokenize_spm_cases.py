"""Writes ``llama-tokenize-spm.json``: the ids ``llama-tokenize`` gives a few hundred strings with a small
SentencePiece (``tokenizer.ggml.model = llama``) vocabulary that ``spm_vocab_gguf`` builds from code, so the
tokenizer test compares against llama.cpp's SPM rule (a ``' '`` prefix on every text piece that starts the
text or follows a special token, spaces as U+2581, merges by score, byte fallback) without llama.cpp and
without shipping a model's vocabulary.

Run from the repository root (llama.cpp built by ``make llama-cpp``): ``python tests/data/llama_tokenize_spm_cases.py``.
The strings are ``llama_tokenize_cases.cases()`` plus SentencePiece edge cases: whitespace runs, leading and
trailing spaces, special tokens next to text, Llama 2 ``[INST]`` prompts, U+2581 in the text, byte fallback.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "llama-tokenize-spm.json"
TEXT = ROOT / "mechserve" / "bench" / "data" / "declaration-of-independence.txt"

SPM_EDGE = [
    " Hello  world",
    "<s>hi</s>",
    "<s>[INST] hi [/INST]",
    "   ",
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4 </s><s>[INST] and 3+3? [/INST]",
    "[INST] hi [/INST] answer</s>",
    "hi</s> there",
    "</s>",
    "<s>",
    "<s> ",
    " <s>",
    "a<s>b",
    "<unk>",
    "x<unk>y",
    "  <s>  ",
    "\n<s>\n",
    "<s><s></s></s>",
    "<s >",
    "< s>",
    "leading",
    " leading",
    "  two leading",
    "trail ",
    "trail  ",
    " both ",
    "\u2581already",
    "\u2581\u2581x \u2581",
    "日本 語",
    "\U0001f600 face",
    "\x00\x01 control",
    "e\u0301 e\u0301",
    "[INST]",
    "<<SYS>>",
    "The The the THE",
]


def spm_vocab_gguf(path: Path) -> Path:
    """A vocab-only GGUF of architecture ``llama`` with a ~2,000-piece SentencePiece vocabulary built
    deterministically from the shipped text (every prefix of every word, with and without U+2581, a few
    whitespace runs, every character of those as a piece as SentencePiece has, seeded scores),
    ``<unk>``/``<s>``/``</s>`` and 256 byte pieces.  Returns ``path``."""
    import gguf

    words = sorted(set(re.findall(r"\w+|[^\w\s]", TEXT.read_text("utf-8"))))
    pieces: dict[str, None] = {}
    for p in ["\u2581" * n for n in range(1, 9)]:
        pieces[p] = None
    for word in words:
        for form in (word, "\u2581" + word):
            for end in range(1, len(form) + 1):
                pieces[form[:end]] = None
    for ch in sorted({ch for p in pieces for ch in p}):  # as SentencePiece: every character of a piece is one
        pieces.setdefault(ch, None)
    rng = random.Random(30)
    normal = list(pieces)
    scores = [-float(i) for i in range(len(normal))]
    rng.shuffle(scores)  # merge order independent of length or alphabet
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *normal]
    types = [2, 3, 3, *[6] * 256, *[1] * len(normal)]
    all_scores = [0.0, 0.0, 0.0, *[0.0] * 256, *scores]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mechserve-spm-test")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(all_scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from llama_tokenize_cases import cases, llama_tokenize

    from mechserve.bench import llama_cpp

    tool = llama_cpp.find_tool("llama-tokenize")
    if tool is None:
        print("llama-tokenize not found (make llama-cpp builds it)", file=sys.stderr)
        return 2
    texts = list(dict.fromkeys([*SPM_EDGE, *cases()]))
    with tempfile.TemporaryDirectory() as tmp:
        gguf = str(spm_vocab_gguf(Path(tmp) / "spm.gguf"))
        with ThreadPoolExecutor(2) as pool:
            ids = list(pool.map(lambda t: llama_tokenize(str(tool), gguf, t), texts))
    doc = {"gguf": "spm_vocab_gguf()", "tool": f"llama-tokenize (llama-cpp-python {llama_cpp.SDIST_VERSION})"}
    doc["cases"] = [{"text": t, "ids": i} for t, i in zip(texts, ids)]
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(texts)} cases -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
