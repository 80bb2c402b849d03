"""What an adaptive EAGLE engine costs at batch 8 when its head sits out (issue 27), measured in one process
beside two engines without speculation.

    PYTHONPATH=$PWD python docs/scripts/eagle_sit_out.py [--mode exact] [--set novel] [--repeats 6]

Four ``LLM``s over one loaded model: ``off``; ``eagle`` (``--spec-method eagle``, adaptive, the head
``mechserve train-draft`` wrote); ``eagle-silent``, the same engine with the forward's hidden rows switched
off and the governor answering "no guesses" for every request (what the sit-out would cost if the proposer
kept nothing); and ``off2``, a second engine without speculation (the noise between two identical engines).
Each repeat runs the set's 8 sessions through each engine, in an order rotated each repeat, after one warm-up
run each.  Prints each engine's total wall seconds, ``off``'s total over it (above 1: faster than ``off``)
and the seconds of each repeat.  A measurement, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--mode", default="exact", choices=["exact", "fast"])
    ap.add_argument("--set", default="novel")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()

    from mechserve.api.config import SpeculativeConfig, dtype_name
    from mechserve.api.params import SamplingParams
    from mechserve.bench.runners import MODES
    from mechserve.bench.spec_decode import Tally, rotated, run_sessions
    from mechserve.bench.spec_workloads import workloads
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.executor.governor import Advice
    from mechserve.model.loader import load_model

    configure_threads()
    dtype, quantization = MODES[args.mode]
    loaded = load_model("smollm2", dtype=dtype, quantization=quantization)
    size = {"dtype": dtype_name(loaded.model.dtype), "quantization": getattr(loaded.model, "quantization", None)}

    def eagle() -> SpeculativeConfig:
        return SpeculativeConfig(method="eagle", num_speculative_tokens=4)

    llms = {
        "off": LLM(loaded, **size),
        "eagle": LLM(loaded, speculative_config=eagle(), **size),
        "eagle-silent": LLM(loaded, speculative_config=eagle(), **size),
        "off2": LLM(loaded, **size),
    }
    silent = llms["eagle-silent"].core.executor
    silent._hidden = False  # no hidden rows asked of the forward, nothing observed
    silent.advise = lambda caps, max_k: Advice(0, {rid: 0 for rid, _ in caps})
    params = SamplingParams(temperature=0.0, max_tokens=128)
    sessions = workloads()[args.set][:8]
    for llm in llms.values():
        run_sessions(llm, sessions, params, Tally())
    walls: dict[str, list[float]] = {name: [] for name in llms}
    for repeat in range(args.repeats):
        for name in rotated(list(llms), repeat):
            tally = Tally()
            run_sessions(llms[name], sessions, params, tally)
            walls[name].append(tally.wall_s)
    for name, w in walls.items():
        ratio = sum(walls["off"]) / sum(w)
        print(f"{name:13s} {sum(w):7.2f} s  off / this {ratio:.3f}  by repeat {[round(x, 2) for x in w]}")


if __name__ == "__main__":
    main()
