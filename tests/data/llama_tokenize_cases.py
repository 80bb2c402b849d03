"""Writes ``llama-tokenize-smollm2.json``: a few hundred varied strings and the ids ``llama-tokenize`` gives each
with the embedded SmolLM2 GGUF's vocabulary, so the tokenizer test compares against llama.cpp without it.

Run from the repository root (llama.cpp built by ``make llama-cpp``, about 4 minutes on 2 cores):
``python tests/data/llama_tokenize_cases.py``.  The strings are hand-picked edge cases (whitespace runs,
contractions, digits, code, scripts, emoji, special tokens), windows of the shipped text cut anywhere,
and seeded random mixes of characters from many Unicode blocks.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("llama-tokenize-smollm2.json")
TEXT = ROOT / "mechserve" / "bench" / "data" / "declaration-of-independence.txt"

EDGE = [
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "\n",
    "\n\n\n",
    "a\nb\n\nc\n\n\nd",
    "\t",
    "tab\tseparated\tvalues\t",
    " \n \n ",
    "a \n\n b",
    "line\r\nwindows\r\n",
    "Hello world",
    "Hello  world",
    "hello, world!",
    "HELLO WORLD",
    "I'm sure you're right, it's what we'd've done.",
    "DON'T SHOUT, WE'LL HEAR YOU",
    "don't 's 't 're 've 'm 'll 'd",
    "a 12 x123 1212",
    "1234567890",
    "3.14159265358979",
    "1,000,000 and 1.000.000",
    "2024-01-01T12:34:56Z",
    "+1 (555) 123-4567",
    "$100.00 €50 £20 ¥1000",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    '{"name": "Ada", "age": 36, "tags": ["math", "code"]}',
    '<html><body><p class="x">Hi &amp; bye</p></body></html>',
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&b=two#frag",
    "user.name+tag@example.co.uk",
    "   def f():\n\treturn None  \n",
    "x = [1,2,3]; y = {'a': (4, 5)}",
    "你好，世界！",
    "日本語のテキストです。",
    "한국어 문장입니다.",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Naïve café ✓ 1776",
    "e\u0301 versus é",
    "zero\u200bwidth\u200djoiner",
    "👍",
    "👍🏽 thumbs",
    "👨\u200d👩\u200d👧 family",
    "🇫🇷🇩🇪 flags",
    "∑_{i=1}^{n} x_i² ≤ ∞",
    "→ ← ↑ ↓ ⇒ ∀ ∃ ∈",
    "# Title\n\n* item one\n* item two\n\n```python\nprint(1)\n```",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!!!!!!!!????",
    "----------==========",
    "...",
    "....    ....",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start",
    "< |im_start| >",
    "<|not_a_token|>",
    "¿Dónde está la biblioteca?",
    "Ünïcödé wörds ärë fün",
    "ﬁ ligature and Ⅻ roman",
    "\u00a0non-breaking\u00a0space",
    "mixed 中文 and English 123",
    "CamelCaseIdentifierName snake_case_name kebab-case-name",
    "'quoted' \"double\" `back`",
    "(((nested)))  [[[brackets]]]  {{{braces}}}",
    "The year 1776. The year 2026.",
    "0x1F 0b1010 0o777 1e-9",
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n",
    "      ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœ",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "あいうえおかきくけこさしすせそアイウエオ",
    "😀😂🥲🤖🚀🌍🔥✨❤️👍",
    "∀∂∃∅∇∈∉∋∏∑−∗√∝∞∠∧∨∩∪∫≈≠≡≤≥",
    "'s 't 're 've 'm 'll 'd ",
]


def cases() -> list[str]:
    rng = random.Random(30)
    text = TEXT.read_text()
    out = list(EDGE)
    for _ in range(110):
        start = rng.randrange(len(text) - 10)
        out.append(text[start : start + rng.choice([1, 2, 5, 20, 80, 300])])
    for _ in range(120):
        n = rng.randint(1, 40)
        picked = rng.sample(POOLS, rng.randint(1, 4))
        out.append("".join(rng.choice(rng.choice(picked)) for _ in range(n)))
    return [s for s in dict.fromkeys(out) if s]


def llama_tokenize(tool: str, gguf: str, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        done = subprocess.run(
            [tool, "-m", gguf, "-f", f.name, "--ids", "--log-disable"], capture_output=True, text=True, check=True
        )
    finally:
        Path(f.name).unlink()
    line = [x for x in done.stdout.splitlines() if x.startswith("[")][-1]
    return [int(t) for t in json.loads(line)]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from mechserve.bench import llama_cpp
    from mechserve.model.checkpoint import embedded_gguf

    tool = llama_cpp.find_tool("llama-tokenize")
    if tool is None:
        print("llama-tokenize not found (make llama-cpp builds it)", file=sys.stderr)
        return 2
    gguf = str(embedded_gguf())
    texts = cases()
    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(lambda t: llama_tokenize(str(tool), gguf, t), texts))
    doc = {"gguf": Path(gguf).name, "tool": f"llama-tokenize (llama-cpp-python {llama_cpp.SDIST_VERSION})"}
    doc["cases"] = [{"text": t, "ids": i} for t, i in zip(texts, ids)]
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(texts)} cases -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
