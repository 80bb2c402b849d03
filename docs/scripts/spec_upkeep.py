"""What an adaptive speculative engine costs at batch 8 when it guesses nothing (issue 27): each proposer's
upkeep, measured in one process beside its guessing self and two engines without speculation.

    PYTHONPATH=$PWD python docs/scripts/spec_upkeep.py [--mode fast] [--set novel] [--repeats 10] \
        [--methods ngram suffix eagle]

``LLM``s over one loaded model: ``off`` and ``off2`` (no speculation: ``off2`` shows the noise between two
identical engines) and, for each method (adaptive, 4 guesses), the engine as built and the same engine
``-silent``: every step it asks its proposer and prices the guesses by the guessing engine's procedure
(``advise``: prompt lookup's index and suffix decoding's request tree brought up to date with every new id by
``available``, the governor's pricing; on its own numbers, which differ: its acceptance records never leave the
prior, since no guess of its is judged, and its measured costs follow its own steps), then drafts nothing
(every request limited to 0).  An EAGLE engine also stops asking the forward for hidden rows, so its head has
no state to draft from: ``available`` answers 0 and nothing is priced.  The rest of a speculative step runs as
well (the proposal, which keeps suffix decoding's global tree up to date; the windows, the settle, the
acceptance records), so ``off`` over it is that upkeep, and the silent engine over the guessing
one is what the guesses themselves cost or gain.  Each repeat runs the set's 8 sessions (128 new ids per
turn, greedy) through each engine in an order rotated each repeat (``bench.spec_decode.rotated``), after one
warm-up run each; suffix decoding forgets finished requests before each run, as the bench does.  Prints each
engine's ids per second, ``off``'s time over its time for the same ids (above 1: faster) with the lowest and
highest repeat, forwards and guesses drafted.  A measurement, not a test: run it on an idle machine.

The wall clock alone cannot see 1% here: on a 2-core machine the forward's own time drifts by several percent
between repeats.  So the script also times the model's forward apart from the rest of each engine's run
(``--split``, on by default: a wrapper around the model class's ``forward``, whose cost is one clock read per
forward) and prints, per engine, the seconds in the forward, the seconds outside it, and the rest over
``off``'s rest.  Engines that ran the same forwards (no guess drafted: the same rows in the same steps) can
only differ by the rest.  The rest is also printed as the calling thread's CPU time outside the forward
(``time.thread_time``): the Python work itself, which waiting on a busy machine does not inflate.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--mode", default="fast", choices=["exact", "fast"])
    ap.add_argument("--set", default="novel")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix", "eagle"])
    ap.add_argument("--no-split", dest="split", action="store_false", help="do not time the forward apart")
    ap.add_argument(
        "--python-tree", action="store_true", help="also suffix decoding on the Python suffix tree (suffix-python)"
    )
    args = ap.parse_args()
    if args.python_tree and "suffix" not in args.methods:
        ap.error("--python-tree adds suffix decoding on the Python trees beside --methods suffix; add suffix")

    from mechserve.api.config import SpeculativeConfig, dtype_name
    from mechserve.api.params import SamplingParams
    from mechserve.bench.runners import MODES
    from mechserve.bench.spec_decode import Tally, forget_finished, rotated, run_sessions, spread
    from mechserve.bench.spec_workloads import workloads
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.executor.governor import Advice
    from mechserve.model.loader import load_model

    def answers_none(advise: Callable[[Sequence[tuple[str, int]], int], Advice]) -> Callable[..., Advice]:
        """``advise`` asked as the guessing engine asks it (the proposer answers ``available``, the governor
        prices), its answer replaced by "no guesses" for every request."""

        def silent(caps: Sequence[tuple[str, int]], max_k: int) -> Advice:
            advise(caps, max_k)
            return Advice(0, {rid: 0 for rid, _ in caps})

        return silent

    configure_threads()
    dtype, quantization = MODES[args.mode]
    loaded = load_model("smollm2", dtype=dtype, quantization=quantization)
    size = {"dtype": dtype_name(loaded.model.dtype), "quantization": getattr(loaded.model, "quantization", None)}
    llms = {"off": LLM(loaded, **size), "off2": LLM(loaded, **size)}
    for method in args.methods:
        for name in (method, f"{method}-silent"):
            llms[name] = LLM(
                loaded, speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=4), **size
            )
        silent = llms[f"{method}-silent"].core.executor
        silent._hidden = False  # no hidden rows asked of the forward, so an EAGLE head observes none
        silent.advise = answers_none(silent.advise)
    if args.python_tree:
        with mock.patch.dict(os.environ, {"MECHSERVE_SUFFIX_TREE": "python"}):  # read when the proposer is built
            llms["suffix-python"] = LLM(
                loaded, speculative_config=SpeculativeConfig(method="suffix", num_speculative_tokens=4), **size
            )
    current = ["warm-up"]
    forward_s: dict[str, float] = dict.fromkeys([*llms, "warm-up"], 0.0)
    forward_cpu: dict[str, float] = dict.fromkeys([*llms, "warm-up"], 0.0)
    cpu_s: dict[str, float] = dict.fromkeys(llms, 0.0)
    if args.split:
        model_type = type(loaded.model)
        forward = model_type.forward

        def timed(self: object, *a: object, **k: object) -> object:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return forward(self, *a, **k)
            finally:
                forward_s[current[0]] += time.perf_counter() - t0
                forward_cpu[current[0]] += time.thread_time() - c0

        model_type.forward = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=128)
    sessions = workloads()[args.set][:8]
    for llm in llms.values():
        forget_finished(llm)
        run_sessions(llm, sessions, params, Tally())
    tallies = {name: Tally() for name in llms}
    for repeat in range(args.repeats):
        for name in rotated(list(llms), repeat):
            forget_finished(llms[name])
            current[0] = name
            t = tallies[name]
            before = (t.output_tokens, t.wall_s)
            c0 = time.thread_time()
            run_sessions(llms[name], sessions, params, t)
            cpu_s[name] += time.thread_time() - c0
            t.repeats.append((t.output_tokens - before[0], t.wall_s - before[1]))
        current[0] = "warm-up"
    off = tallies["off"]
    print(f"{args.set}, batch 8, {args.mode}, {args.repeats} repeats")
    for name, t in tallies.items():
        r = t.report(off)  # the bench's figures: speedup = tok/s over off's; by repeat likewise
        print(
            f"  {name:14s} {r['tok_s']:7.1f} ids/s  x{r['speedup']:.3f} ({spread(r['speedup_by_repeat'])})"
            f"  forwards {t.forwards:5d}  drafted {t.drafted:6d}"
        )
    if args.split:
        rest0 = off.wall_s - forward_s["off"]
        cpu0 = cpu_s["off"] - forward_cpu["off"]
        print("  the forward timed apart (seconds over all repeats; cpu: the calling thread's CPU time outside it):")
        for name, t in tallies.items():
            rest = t.wall_s - forward_s[name]
            cpu = cpu_s[name] - forward_cpu[name]
            print(
                f"  {name:14s} wall {t.wall_s:8.3f}  forward {forward_s[name]:8.3f}  rest {rest:7.3f}"
                f"  rest - off's {rest - rest0:+7.3f} ({(rest - rest0) / off.wall_s:+.2%} of off's wall)"
                f"  cpu {cpu:7.3f} - off's {cpu - cpu0:+7.3f} ({(cpu - cpu0) / off.wall_s:+.2%})"
            )


if __name__ == "__main__":
    main()
