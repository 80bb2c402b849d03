"""Structured outputs benchmark: grammar compile time, mask cost per step, constrained vs unconstrained.

``mechserve bench structured`` (``--help`` for the knobs), on the model's own tokenizer, in one process:

* ``tokenizer_s``: building llguidance's tokenizer (once per engine);
* ``compile_ms``: per constraint kind (a nested "person" schema, a 40-property schema with ``$defs``,
  any JSON object, a regex, a choice, a Lark and a GBNF grammar), the median of ``--reps`` cold
  compiles (the cache emptied each time);
* ``mask``: at each batch size B, B matchers walk valid "person" instances token by token; per step,
  ``fill_us`` is llguidance writing B masks (``GrammarMatcher.fill``) and ``apply_us`` unpacking them
  and masking ``[B, V]`` float32 logits (``allowed_rows`` + the sampler's ``process_logits``: a copy of
  the logits and one masked write per row), medians over the steps, in wall time and in this thread's
  CPU time (``*_cpu_us``, which a loaded machine's descheduling does not inflate);
* ``e2e``: greedy generation of ``--max-tokens`` tokens through ``LLM`` at each batch size,
  unconstrained and constrained by the person schema, interleaved round by round: wall seconds,
  output tokens, ms per output token, and the executor's own mask time per step
  (``TorchExecutor.grammar_mask_s``: matcher sync, fill and unpack).

``--json`` prints the report as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from mechserve.cli.parser import Bounded

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
        "city": {"enum": ["Paris", "Lyon", "Berlin", "Madrid", "Rome"]},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "city", "languages", "address"],
    "additionalProperties": False,
}
NAMES = ["Alice Martin", "Bob Stone", "Chloé Durand", "Dmitri Ivanov", "Eva Lopez", "Farid Haddad", "Grace Kim"]


def big_schema() -> dict[str, Any]:
    """40 properties over ``$defs`` / ``$ref``, ``anyOf`` and nested arrays (the report's "larger schema")."""
    defs = {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
        "tag": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer"}]},
    }
    props: dict[str, Any] = {}
    for i in range(40):
        kind = i % 4
        props[f"field_{i}"] = (
            {"$ref": "#/$defs/point"}
            if kind == 0
            else {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}
            if kind == 1
            else {"type": "string", "maxLength": 16}
            if kind == 2
            else {"type": "integer", "minimum": 0}
        )
    return {"$defs": defs, "type": "object", "properties": props, "required": sorted(props)[:20]}


def constraints() -> dict[str, Any]:
    from mechserve.api.params import StructuredOutputsParams as S

    return {
        "json_schema_person": S(json=PERSON),
        "json_schema_40_props": S(json=big_schema()),
        "json_object": S(json_object=True),
        "regex_date": S(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        "choice_4": S(choice=("yes", "no", "maybe", "don't know")),
        "lark_arith": S(grammar='start: expr\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[0-9]+/'),
        "gbnf_arith": S(grammar='root ::= num (("+" | "*") num)*\nnum ::= [0-9]+'),
    }


def person(i: int) -> str:
    """A valid instance of ``PERSON`` in the compact form the grammar allows (no free whitespace)."""
    name = NAMES[i % len(NAMES)]
    doc = {
        "name": name,
        "age": 20 + (7 * i) % 60,
        "email": name.lower().replace(" ", ".").replace("é", "e") + "@example.com",
        "city": ["Paris", "Lyon", "Berlin", "Madrid", "Rome"][i % 5],
        "languages": ["French", "English", "Spanish", "German"][: 1 + i % 4],
        "address": {"street": f"{10 + i} Rue des Lilas", "zip": f"{75000 + i:05d}"},
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def compile_times(compiler: Any, reps: int) -> dict[str, float]:
    out = {}
    for name, so in constraints().items():
        times = []
        for _ in range(reps):
            compiler._cache.clear()
            began = time.perf_counter()
            compiler.compile(so)
            times.append(time.perf_counter() - began)
        out[name] = round(1e3 * statistics.median(times), 3)
    return out


def mask_costs(compiler: Any, tokenizer: Any, vocab: int, batch: int) -> dict[str, Any]:
    """Per step of ``batch`` matchers walking person instances: median fill and apply microseconds."""
    import torch

    from mechserve.api.params import GREEDY, StructuredOutputsParams
    from mechserve.executor.sampling import Row, process_logits
    from mechserve.executor.structured import allowed_rows, new_bitmask

    grammar = compiler.compile(StructuredOutputsParams(json=PERSON))
    eos = grammar.eos_token
    texts = [[*tokenizer.encode(person(i), add_special_tokens=False), eos] for i in range(batch)]
    matchers = [grammar.matcher() for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    fills, applies, fills_cpu, applies_cpu = [], [], [], []
    for step in range(max(len(t) for t in texts)):
        live = [j for j in range(batch) if step < len(texts[j])]
        bm = new_bitmask(batch, vocab)
        began, began_cpu = time.perf_counter(), time.thread_time()
        for j in live:
            matchers[j].fill(bm, j)
        filled, filled_cpu = time.perf_counter(), time.thread_time()
        allowed = allowed_rows(bm, vocab)
        process_logits(logits, [Row(GREEDY, step, allowed=allowed[j]) for j in range(batch)])
        applied, applied_cpu = time.perf_counter(), time.thread_time()
        fills.append(filled - began)
        applies.append(applied - filled)
        fills_cpu.append(filled_cpu - began_cpu)
        applies_cpu.append(applied_cpu - filled_cpu)
        for j in live:
            matchers[j].accept([texts[j][step]])
    us = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    return {
        "steps": len(fills),
        "fill_us": us(fills),
        "apply_us": us(applies),
        # this thread's CPU time: what descheduling on a loaded machine does not inflate
        "fill_cpu_us": us(fills_cpu),
        "apply_cpu_us": us(applies_cpu),
    }


def e2e(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    from mechserve.api.params import SamplingParams, StructuredOutputsParams
    from mechserve.entrypoints.llm import LLM

    llm = LLM(loaded, num_pages=args.num_pages, max_step_tokens=args.max_step_tokens)
    prompt = "Invent a person and describe them as JSON with name, age, email, city, languages and address."
    modes = {
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
        "constrained": SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=PERSON)
        ),
    }
    llm.generate([prompt], modes["constrained"], use_tqdm=False)  # compile and warm up once
    report: dict[str, Any] = {}
    for batch in args.batches:
        tallies = {m: {"wall_s": 0.0, "output_tokens": 0, "steps": 0, "mask_s": 0.0, "valid": 0} for m in modes}
        for _ in range(args.rounds):
            for mode, params in modes.items():  # interleaved, so a noisy machine slows both alike
                ex = llm.core.executor
                mask0, steps0 = getattr(ex, "grammar_mask_s", 0.0), llm.core.step_counter
                began = time.perf_counter()
                outs = llm.generate([prompt] * batch, params, use_tqdm=False)
                t = tallies[mode]
                t["wall_s"] += time.perf_counter() - began
                t["steps"] += llm.core.step_counter - steps0
                t["mask_s"] += getattr(ex, "grammar_mask_s", 0.0) - mask0
                t["output_tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                t["valid"] += sum(_parses(o.outputs[0].text) for o in outs)
        report[f"batch_{batch}"] = {
            m: {
                "wall_s": round(t["wall_s"], 3),
                "output_tokens": t["output_tokens"],
                "ms_per_token": round(1e3 * t["wall_s"] / max(1, t["output_tokens"]), 3),
                "ms_per_step": round(1e3 * t["wall_s"] / max(1, t["steps"]), 3),
                "mask_ms_per_step": round(1e3 * t["mask_s"] / max(1, t["steps"]), 3),
                "outputs_that_parse": f"{t['valid']}/{batch * args.rounds}",
            }
            for m, t in tallies.items()
        }
        print(f"e2e batch {batch}: {json.dumps(report[f'batch_{batch}'])}", file=sys.stderr)
    return report


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import os

    import torch

    from mechserve.engine.executors import configure_threads
    from mechserve.executor.structured import GrammarCompiler
    from mechserve.model.loader import load_model

    configure_threads()
    loaded = load_model(args.model)
    vocab = loaded.model.arch.vocab_size
    compiler = GrammarCompiler(loaded.tokenizer, vocab)
    began = time.perf_counter()
    compiler._tokenizer()
    report: dict[str, Any] = {
        "model": args.model,
        "grammar_engine": "llguidance " + _version("llguidance"),
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "tokenizer_s": round(time.perf_counter() - began, 3),
    }
    report["compile_ms"] = compile_times(compiler, args.reps)
    print(f"compile ms: {json.dumps(report['compile_ms'])}", file=sys.stderr)
    report["mask"] = {f"batch_{b}": mask_costs(compiler, loaded.tokenizer, vocab, b) for b in args.batches}
    print(f"mask: {json.dumps(report['mask'])}", file=sys.stderr)
    if not args.no_e2e:
        report["e2e"] = e2e(args, loaded)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``mechserve bench structured --help``)."""
    add = parser.add_argument
    add("--model", default="smollm2", help="'smollm2' (default), a local model directory or a GGUF file")
    add("--batches", nargs="+", type=Bounded(int, ge=1, le=256), default=[1, 32], help="batch sizes (1 32)")
    add(
        "--max-tokens", type=Bounded(int, ge=1, le=4096), default=96, help="new tokens per request in the e2e part (96)"
    )
    add("--rounds", type=Bounded(int, ge=1, le=100), default=1, help="e2e rounds per batch size (1)")
    add("--reps", type=Bounded(int, ge=1, le=100), default=5, help="cold compiles per constraint (5)")
    add("--num-pages", type=Bounded(int, ge=1, le=1 << 20), default=1024, help="KV pages of the e2e engine (1024)")
    add("--max-step-tokens", type=Bounded(int, ge=1, le=1 << 16), default=2048, help="token budget per step (2048)")
    add("--no-e2e", action="store_true", help="only the compile and mask measurements")
    add("--json", action="store_true", help="print only the report, as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the report (indented unless ``--json``); returns 0."""
    report = bench(args)
    print(json.dumps(report, indent=None if args.json else 2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
