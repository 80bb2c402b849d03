"""Greedy ids of mechserve and llama.cpp on the same GGUF file: for each file kind given (default f32, q8_0,
q4_k_m, q5_k_m, q6_k: the embedded model's, made by ``llama-quantize`` on first use), ``llama-server`` with one
slot and ``LLM(model=FILE)`` complete the same token-id prompts greedily, EOS ignored; the script prints per
file how many requests are identical and the mean share of each output the two engines share before their
first difference.  mechserve runs in float32 activations (``--dtype float32``) or bfloat16.

``python docs/scripts/gguf_greedy_parity.py [--kinds f32,q4_k_m] [--tokens 32] [--dtype float32]``
(llama.cpp built by ``make llama-cpp``; about 2 minutes per file on 2 loaded cores).
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "The Declaration of Independence was signed in",
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The three laws of motion are",
    "import numpy as np\n\n",
    "In 1969, the first humans",
    "The best way to learn a language is",
    "Water boils at",
    "The mitochondria is",
    "List of prime numbers: 2, 3, 5,",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="f32,q8_0,q4_k_m,q5_k_m,q6_k")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="llama-server threads (default 1)")
    args = parser.parse_args()

    from mechserve import LLM, SamplingParams
    from mechserve.bench import llama_cpp

    for kind in args.kinds.split(","):
        gguf = llama_cpp.ensure_gguf(kind)
        llm = LLM(str(gguf), dtype=args.dtype)
        prompts = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        del llm
        server = llama_cpp.LlamaServer(gguf, threads=args.threads, slots=1, context=512)
        try:
            theirs = [server.complete(p, args.tokens).tokens for p in prompts]
        finally:
            server.close()
        same = sum(a == b for a, b in zip(ours, theirs))
        shares = []
        for a, b in zip(ours, theirs):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shares.append(n / max(len(a), 1))
        print(
            f"{gguf.name}: {same}/{len(prompts)} requests identical over {args.tokens} tokens, "
            f"mean common prefix {sum(shares) / len(shares):.0%} (mechserve {args.dtype})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
