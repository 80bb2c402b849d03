"""``mechserve generate "prompt"``: continue a raw prompt with a real model under the top rung (m11).

Prints one compact line per engine step, then the prompt and its
continuation; ``--json`` prints every step record as JSON, then one object
with the request's summary, text and token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.text import Text

from mechserve.spec import m11_parallelism as m11


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``generate``'s arguments to ``parser``."""
    parser.add_argument("prompt", help="raw text to continue (no chat template)")
    parser.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded, default) or a local Hugging Face model directory"
    )
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens to generate (default 64)")
    parser.add_argument(
        "--max-step-tokens", type=int, default=512, metavar="N", help="per-step token budget (default 512)"
    )
    parser.add_argument("--page-size", type=int, default=16, metavar="N", help="KV positions per page (default 16)")
    parser.add_argument(
        "--num-pages",
        type=int,
        default=None,
        metavar="N",
        help="KV pages in the pool (default: enough for the request)",
    )
    parser.add_argument(
        "--spec-len", type=int, default=0, metavar="N", help="prompt-lookup guesses per decode step (default 0)"
    )
    parser.add_argument("--json", action="store_true", help="print step records and the result as JSON lines")


def run(args: argparse.Namespace) -> int:
    """Run ``generate``; returns the exit status (2 with one error line on stderr for bad input)."""
    from mechserve.backends.engine import EngineConfig, configure_threads, generate
    from mechserve.backends.models import ModelLoadError, load_model

    try:
        if args.max_tokens <= 0:
            raise ValueError(f"--max-tokens must be > 0, got {args.max_tokens}")
        config = EngineConfig(
            max_step_tokens=args.max_step_tokens,
            page_size=args.page_size,
            num_pages=args.num_pages,
            spec_len=args.spec_len,
        )
        configure_threads()
        loaded = load_model(args.model)
        console = Console(highlight=False, soft_wrap=True)
        show = _print_json if args.json else (lambda record: console.print(_trace_line(record)))
        started = time.perf_counter()
        result = generate(
            loaded.model,
            [args.prompt],
            args.max_tokens,
            tokenizer=loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            config=config,
            on_step=show,
        )
        elapsed = time.perf_counter() - started
    except (ModelLoadError, ValueError, m11.OutOfPages) as e:
        print(f"mechserve: error: {_flat(e)}", file=sys.stderr)
        return 2
    done = result.completions[0]
    if args.json:
        final = dict(result.summary[0], text=done.text, token_ids=list(done.token_ids))
        print(json.dumps(final))
        return 0
    console.print(Text(args.prompt, style="dim") + Text(done.text or "", style="bold"))
    n = len(done.token_ids)
    console.print(
        Text(
            f"{n} token(s) in {len(result.records)} step(s), {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s), "
            f"finished {done.finish_reason}",
            style="dim",
        )
    )
    return 0


def _print_json(record: m11.StepRecord) -> None:
    print(json.dumps(record.to_json()), flush=True)


def _trace_line(record: m11.StepRecord) -> Text:
    """One step as ``step N  scheduled ..  executed r=n  sampled r=TOKEN ...``; empty fields left out."""
    line = Text(f"step {record.step:>3}", style="bold")
    fields: list[tuple[str, Any]] = [
        ("scheduled", " ".join(record.scheduled)),
        ("executed", _pairs(record.executed)),
        ("sampled", _pairs({k: v.value for k, v in record.sampled.items()})),
        ("finished", _pairs({k: v.value for k, v in record.finished.items()})),
        ("preempted", " ".join(record.preempted)),
        ("reused", _pairs(record.reused)),
    ]
    if any(record.drafted.values()):
        fields.append(("accepted", _pairs({k: f"{record.accepted[k]}/{d}" for k, d in record.drafted.items()})))
    for name, value in fields:
        if value:
            line += Text(f"  {name} ", style="cyan") + Text(value)
    return line


def _pairs(mapping: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in mapping.items())


def _flat(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
