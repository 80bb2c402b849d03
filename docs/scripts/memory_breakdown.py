"""Where a mechserve process's memory goes, one mode in one fresh process: resident set size (RSS, and
its anonymous and file-backed parts) after each stage of what ``bench run`` does before and during a run.

    PYTHONPATH=$PWD python docs/scripts/memory_breakdown.py MODE [MODEL] [--pages N]

MODE: exact, fast, q4_1, q8_0 (the bench's modes of the embedded model) or gguf-f32 / gguf-bf16 (MODEL,
a GGUF file, with float32 / bfloat16 activations).  Stages: the interpreter with torch, transformers
and mechserve imported; the model loaded (tokenizer included); an ``EngineCore`` with the KV pool
(``--pages N``, else the pool's automatic size); one request of 512 prompt and 64 output tokens; 8
requests of 512 + 64 at once.  Each line gives RSS (VmRSS), its anonymous and file parts (RssAnon,
RssFile), the peak so far (VmHWM), the model's bytes (weights as held) and the pool's bytes.  Used
for docs/benchmarks.md ("Memory").
"""

from __future__ import annotations

import sys
from pathlib import Path


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def say(stage: str, extra: str = "") -> None:
    s = status()
    mib = {k: v / 2**20 for k, v in s.items()}
    print(
        f"{stage:34s} RSS {mib['VmRSS']:7.0f} MiB (anon {mib['RssAnon']:6.0f}, file {mib['RssFile']:5.0f})"
        f"  peak {mib['VmHWM']:7.0f} MiB  {extra}",
        flush=True,
    )


def main() -> None:
    args = sys.argv[1:]
    pages = None
    if "--pages" in args:
        i = args.index("--pages")
        pages = int(args[i + 1])
        del args[i : i + 2]
    mode = args[0]
    model = args[1] if len(args) > 1 else "smollm2"
    say("python started")
    import torch
    import transformers  # noqa: F401  (what any mechserve process imports to tokenize)

    import mechserve.engine.core  # noqa: F401

    say("torch, transformers, mechserve imported")
    from mechserve.api.config import EngineConfig, dtype_name
    from mechserve.api.params import SamplingParams
    from mechserve.bench.runners import MODES
    from mechserve.engine.core import EngineCore
    from mechserve.engine.executors import configure_threads
    from mechserve.model.loader import load_model
    from mechserve.model.memory import model_bytes

    configure_threads()
    if mode.startswith("gguf-"):
        dtype, quantization = (torch.float32 if mode == "gguf-f32" else torch.bfloat16), None
    else:
        dtype, quantization = MODES[mode]
    loaded = load_model(model, dtype=dtype, quantization=quantization)
    say("model loaded", f"model {model_bytes(loaded.model) / 2**20:.0f} MiB")
    config = EngineConfig(dtype=dtype_name(dtype), quantization=quantization, num_pages=pages, max_running=None, seed=0)
    core = EngineCore(loaded, config)
    say(
        "engine built (KV pool allocated)",
        f"pool {core.kv_bytes / 2**20:.0f} MiB, {core.num_pages} pages ({core.sized_by})",
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    core.add_request(list(range(10, 522)), params)
    core.run_until_idle()
    say("1 request (512 + 64)")
    for r in range(8):
        core.add_request([(7 * r + i) % 1000 + 10 for i in range(512)], params)
    core.run_until_idle()
    say("8 requests at once (512 + 64 each)")


if __name__ == "__main__":
    main()
