"""Forced runs (m14) on a real JSON-schema output: SmolLM2 greedy, forcing on vs off, side by side (docs/benchmarks.md)."""

import json
import time

from mechserve import LLM, SamplingParams
from mechserve.executor import torch_executor

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 12},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]}, "maxItems": 2},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "languages", "employed"],
    "additionalProperties": False,
}
llm = LLM("smollm2")
prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(8)]
sp = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": SCHEMA})
for batch in (1, 8):
    res = {}
    for label, cap in (("on", 256), ("off", 0), ("on", 256), ("off", 0)):
        torch_executor.MAX_FORCED_RUN = cap
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.chat(prompts[:batch], sp, use_tqdm=False) if batch > 1 else llm.chat(prompts[0], sp, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps = len(llm.trace) if llm.trace is not None else None
        ids = [o.outputs[0].token_ids for o in outs]
        toks = sum(len(i) for i in ids)
        res.setdefault(label, []).append((wall, cpu, steps, toks, ids))
        for o in outs:
            json.loads(o.outputs[0].text)  # constrained: every output parses
    on, off = res["on"][-1], res["off"][-1]
    print(
        f"batch {batch}: ids identical {on[4] == off[4]}; tokens {on[3]}; steps on {on[2]} off {off[2]}; "
        f"tokens/step on {on[3] / on[2]:.2f} off {off[3] / off[2]:.2f}; wall on {on[0]:.2f}s off {off[0]:.2f}s "
        f"({off[0] / on[0]:.2f}x); cpu on {on[1]:.2f}s off {off[1]:.2f}s ({off[1] / on[1]:.2f}x)"
    )
