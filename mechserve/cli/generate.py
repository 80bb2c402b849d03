"""``mechserve generate "prompt"``: continue a raw prompt with a real model under the top rung (m12).

Prints one compact line per engine step, then the prompt and its
continuation and a timing line (prefill and decode separately); ``--json``
prints every step record as JSON, then ``{"summary": [...], "outputs":
[...]}``; ``--quiet`` prints only the generated text (or, with ``--json``,
only the last line).

Everything that does not need the model (sizes, the prompt) is checked by
the argument parser before the model is loaded; the pool's memory and m12's
door (a request longer than the model's context, or one that can never fit
the pool) are checked before the KV cache is allocated.  Every problem is one
``mechserve: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.text import Text

from mechserve.cli.errors import CliError, engine_failure
from mechserve.spec import m12_admission_control as m12
from mechserve.workload import ENGINE_LIMITS, MAX_NEW_TOKENS, MAX_SLOTS

MAX_KV_MEMORY = 1 << 50
DEFAULT_MAX_STEP_TOKENS = 2048  # vLLM's chunked-prefill default (mechserve.backends.engine)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|(b)?)\s*", re.IGNORECASE)


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[minimum, maximum]``, with a message naming the bound."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            bound = "> 0" if minimum == 1 else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum} (mechserve's limit), got {value}")
        return value

    return convert


def prompt_text(text: str) -> str:
    """An argparse ``type=`` for the prompt: any text but the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (give the text to continue)")
    return text


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``2GiB``, ``1.5G``, ``4GB`` (powers of 1000) or a plain number of bytes.

    ``K``/``M``/``G``/``T`` with or without ``i``/``iB`` are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` are powers of 1000.  Raises
    ``argparse.ArgumentTypeError`` for anything else, zero, or more than
    ``MAX_KV_MEMORY``.
    """
    match = _SIZE.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB or 2GiB, got {text!r}")
    number, unit, binary, _ = match.groups()
    unit = (unit or "").lower()
    decimal = bool(unit) and not binary and text.strip().lower().endswith("b")
    scale = 1000 ** "bkmgt".index(unit) if decimal else _UNITS[unit]
    value = float(number) * scale
    if not math.isfinite(value) or value > MAX_KV_MEMORY:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_KV_MEMORY} bytes (1 PiB), got {text!r}")
    if int(value) <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``generate``'s arguments to ``parser``; each is validated by its ``type=``."""
    parser.add_argument("prompt", type=prompt_text, help="raw text to continue (no chat template)")
    parser.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded, default) or a local Hugging Face model directory"
    )
    parser.add_argument(
        "--max-tokens",
        type=integer(0, MAX_NEW_TOKENS),
        default=64,
        metavar="N",
        help="new tokens to generate (default 64; 0 generates nothing); prompt + N must fit the model's context",
    )
    parser.add_argument(
        "--max-step-tokens",
        type=integer(1, ENGINE_LIMITS["max_step_tokens"]),
        default=DEFAULT_MAX_STEP_TOKENS,
        metavar="N",
        help=f"per-step token budget, the prefill chunk size (default {DEFAULT_MAX_STEP_TOKENS})",
    )
    parser.add_argument(
        "--page-size",
        type=integer(1, ENGINE_LIMITS["page_size"]),
        default=16,
        metavar="N",
        help="KV positions per page (default 16)",
    )
    parser.add_argument(
        "--num-pages",
        type=integer(1, ENGINE_LIMITS["num_pages"]),
        default=None,
        metavar="N",
        help="KV pages in the pool (default: sized from --kv-memory, else enough for the request)",
    )
    parser.add_argument(
        "--kv-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="a KV cache budget such as 512MiB or 2GiB: sizes the pool when --num-pages is not given, "
        "and the cache must fit in it",
    )
    parser.add_argument(
        "--spec-len",
        type=integer(0, ENGINE_LIMITS["spec_len"]),
        default=0,
        metavar="N",
        help="prompt-lookup guesses per decode step (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print step records and the result as JSON lines")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print only the generated text (with --json, only the result)"
    )


def check_arguments(args: argparse.Namespace) -> None:
    """The checks that span several flags, before the model is loaded; raises ``CliError``."""
    if args.num_pages is not None and args.num_pages * args.page_size > MAX_SLOTS:
        raise CliError(
            f"--num-pages {args.num_pages} x --page-size {args.page_size} = {args.num_pages * args.page_size} "
            f"slots, over mechserve's limit of {MAX_SLOTS} slots; lower one of them"
        )


def run(args: argparse.Namespace) -> int:
    """Run ``generate``; returns 0.

    Raises ``CliError`` (one line, exit status 2) for a bad argument, a model
    that cannot be loaded, a KV cache that does not fit, a request the door
    rejects, or an engine failure part-way (after the steps before it are
    printed).
    """
    check_arguments(args)
    from mechserve.backends.engine import EngineConfig, Generation, KVMemoryError, configure_threads
    from mechserve.backends.models import ModelLoadError, load_model

    try:
        config = EngineConfig(
            max_step_tokens=args.max_step_tokens,
            page_size=args.page_size,
            num_pages=args.num_pages,
            spec_len=args.spec_len,
            kv_memory=args.kv_memory,
        )
        configure_threads()
        loaded = load_model(args.model)
        generation = Generation(
            loaded.model,
            [args.prompt],
            args.max_tokens,
            tokenizer=loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            config=config,
        )
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except KVMemoryError as exc:
        raise CliError(kv_message(exc)) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if generation.rejections:
        rejected = generation.rejections[0]
        raise CliError(
            f"request rejected: {rejected.reason} ({rejected.detail}; {REJECT_HINTS.get(rejected.reason, 'see mech-notes/12-admission-control.md')})"
        )
    clock = Clock(generation.requests[0].request_id)
    console = Console(highlight=False, soft_wrap=True)
    show = (lambda record: None) if args.quiet else _print_json if args.json else _print_trace(console)
    try:
        generation.allocate()
    except KVMemoryError as exc:
        raise CliError(kv_message(exc)) from None
    try:
        result = generation.run(clock.wrap(show))
    except Exception as exc:  # an engine or executor failure part-way: the steps so far are printed (D3)
        raise CliError(step_failure(exc, generation.engine.step_counter)) from exc
    clock.stop()
    done = result.completions[0]
    if args.json:
        outputs = [
            {
                "request_id": c.request_id,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
            }
            for c in result.completions
        ]
        print(json.dumps({"summary": result.summary, "outputs": outputs}), flush=True)
    elif args.quiet:
        sys.stdout.write((done.text or "") + "\n")
        sys.stdout.flush()
    else:
        console.print(Text(args.prompt, style="dim") + Text(done.text or "", style="bold"))
        console.print(Text(clock.report(len(done.prompt_ids), len(done.token_ids), done.finish_reason), style="dim"))
    return 0


REJECT_HINTS = {
    "TOO_LONG": "shorten the prompt or lower --max-tokens",
    "NEVER_FITS": "raise --num-pages or --kv-memory, or lower --max-tokens",
    "EMPTY_PROMPT": "give a prompt that encodes to at least one token",
}
_KV_HINTS = {
    "num_pages": "lower --num-pages",
    "kv_memory": "lower --kv-memory",
    "auto": "lower --max-tokens, or size the pool with --num-pages or --kv-memory",
}


def kv_message(exc: Any) -> str:
    """A ``KVMemoryError`` as one line that names the flag to change."""
    text = str(exc)
    if "holds no page" in text:
        return f"{text}; raise --kv-memory or lower --page-size"
    return f"{text}; {_KV_HINTS.get(exc.sized_by, 'lower --num-pages')}"


def step_failure(exc: BaseException, step_counter: int) -> str:
    """The error line for a failure inside ``Generation.run``: ``run``'s wording, or out of memory."""
    from mechserve.backends.engine import first_line, is_allocation_failure

    if is_allocation_failure(exc):
        return (
            f"out of memory during step {step_counter}: {first_line(exc)}; "
            "lower --max-step-tokens (the prefill chunk) or --num-pages"
        )
    return engine_failure(exc, step_counter)


class Clock:
    """Times one request: from the first step to its first sampled token (prefill), then to the end (decode)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started = time.perf_counter()
        self.first: float | None = None
        self.ended: float | None = None
        self.steps = 0

    def wrap(self, show: Callable[[m12.StepRecord], None]) -> Callable[[m12.StepRecord], None]:
        """``show`` with the time of each step recorded first; the clock restarts now."""
        self.started = time.perf_counter()

        def on_step(record: m12.StepRecord) -> None:
            self.steps += 1
            if self.first is None and self.request_id in record.tokens:
                self.first = time.perf_counter()
            show(record)

        return on_step

    def stop(self) -> None:
        self.ended = time.perf_counter()

    def report(self, prompt_tokens: int, tokens: int, finish_reason: str | None) -> str:
        """``N token(s) in S step(s), T s; prefill ...; decode ...; finished R``, never a rate of 0.0."""
        end = self.ended or time.perf_counter()
        parts = [f"{tokens} token(s) in {self.steps} step(s), {end - self.started:.2f} s"]
        if self.first is not None:
            ttft = self.first - self.started
            parts.append(
                f"prefill {prompt_tokens} token(s) in {ttft:.2f} s ({rate(prompt_tokens, ttft)}, "
                f"time to first token {ttft:.2f} s)"
            )
            if tokens > 1:
                decode = end - self.first
                parts.append(f"decode {tokens - 1} token(s) in {decode:.2f} s ({rate(tokens - 1, decode)})")
        parts.append(f"finished {finish_reason}")
        return "; ".join(parts)


def rate(count: int, seconds: float) -> str:
    """``count / seconds`` as ``123 tok/s``, ``12.3 tok/s`` or ``0.012 tok/s``: never rounded to zero."""
    per_second = count / max(seconds, 1e-9)
    if per_second >= 100:
        return f"{per_second:.0f} tok/s"
    if per_second >= 1:
        return f"{per_second:.1f} tok/s"
    return f"{per_second:.2g} tok/s"


def _print_json(record: m12.StepRecord) -> None:
    print(json.dumps(record.to_json()), flush=True)


def _print_trace(console: Console) -> Callable[[m12.StepRecord], None]:
    return lambda record: console.print(_trace_line(record))


def _trace_line(record: m12.StepRecord) -> Text:
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
