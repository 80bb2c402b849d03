"""``mechserve generate "prompt"``: continue a raw prompt (or, with ``--chat``, answer it) with a real model.

The request runs on an ``EngineCore`` (the top rung, m16, over the torch
executor), with vLLM's sampling flags; the default temperature is 0
(greedy), so that the same command prints the same text every time.
Prints one compact line per engine step, then the prompt and its
continuation and a timing line (prefill and decode separately); ``--json``
prints every step record as JSON, then ``{"summary": [...], "outputs":
[...]}`` (one output per sample); ``--quiet`` prints only the generated text
(or, with ``--json``, only the last line).

Everything that does not need the model (sizes, the prompt) is checked by
the argument parser before the model is loaded; the pool's memory and m12's
door (a request longer than the model's context, or one that can never fit
the pool) are checked before the KV cache is allocated.  Every problem is one
``mechserve: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.text import Text

from mechserve.api import config as engine_settings
from mechserve.api.config import DEFAULT_MAX_STEP_TOKENS, DEFAULT_PAGE_SIZE
from mechserve.api.limits import (
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_SAMPLES,
    MAX_SPEC_LEN,
    MAX_SUFFIX_CACHED_REQUESTS,
    MAX_SUFFIX_TREE_DEPTH,
)
from mechserve.api.proposers import DEFAULT_METHOD, DEFAULT_MODEL_METHOD, METHODS, PROPOSERS
from mechserve.cli.engine_args import engine_config, setting
from mechserve.cli.errors import CliError, engine_failure
from mechserve.cli.parser import Bounded, add_device_arguments
from mechserve.cli.viz import VizOutputs, add_output_flags
from mechserve.cli.vllm_names import add_chat_template_argument, apply_chat_template_flag
from mechserve.spec import m16_request_draft_lengths as m16

# The type of a flag that takes any finite number (ranges are checked by ``SamplingParams`` or ``EngineConfig``).
NUMBER = Bounded(float, finite=True)


def prompt_text(text: str) -> str:
    """An argparse ``type=`` for the prompt: any text but the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (give the text to continue)")
    return text


def parse_size(text: str) -> int:
    """An argparse ``type=`` for a size: ``512MiB``, ``2GiB``, ``1.5G``, ``4GB`` or a number of bytes
    (``mechserve.api.config.parse_size``; ``argparse.ArgumentTypeError`` for anything else)."""
    try:
        return engine_settings.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``generate``'s arguments to ``parser``; each is validated by its ``type=``."""
    parser.add_argument(
        "prompt", type=prompt_text, help="raw text to continue (with --chat: the user's message to answer)"
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded, default), a local Hugging Face model directory or a GGUF file",
    )
    add_dtype_argument(parser)
    add_device_arguments(parser)
    parser.add_argument(
        "--max-tokens",
        type=Bounded(int, ge=0, le=MAX_NEW_TOKENS),
        default=64,
        metavar="N",
        help="new tokens to generate (default 64; 0 generates nothing); prompt + N must fit the model's context",
    )
    parser.add_argument(
        "--max-step-tokens",
        type=setting("max_step_tokens"),
        default=DEFAULT_MAX_STEP_TOKENS,
        metavar="N",
        help=f"per-step token budget, the prefill chunk size (default {DEFAULT_MAX_STEP_TOKENS})",
    )
    parser.add_argument(
        "--page-size",
        type=setting("page_size"),
        default=DEFAULT_PAGE_SIZE,
        metavar="N",
        help="KV positions per page (default 16)",
    )
    parser.add_argument(
        "--num-pages",
        type=setting("num_pages"),
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
        type=setting("spec_len"),
        default=None,
        metavar="K",
        help="speculative decoding: at most K guesses per decode step (default 0: off; 3 with --spec-method)",
    )
    parser.add_argument(
        "--world-size",
        type=setting("world_size"),
        default=1,
        metavar="N",
        help="tensor-parallel rank processes, each holding a shard of the weights and KV (default 1); "
        "under torchrun, the number of processes it starts",
    )
    add_speculative_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to the prompt, as one user message"
    )
    add_chat_template_argument(parser, "--chat")
    parser.add_argument("--json", action="store_true", help="print step records and the result as JSON lines")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print only the generated text (with --json, only the result)"
    )
    add_output_flags(parser)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """``--spec-method``, ``--draft-model``, the n-gram bounds, suffix decoding's options and ``--spec-fixed``
    (with ``--spec-len``)."""
    add = parser.add_argument
    methods = ", ".join(
        f"{m.name} ({m.summary}{', with --draft-model' if m.needs_model else ''})" for m in PROPOSERS.values()
    )
    add(
        "--spec-method",
        choices=METHODS,
        default=None,
        help=f"what drafts the guesses: {methods}; default {DEFAULT_METHOD} with --spec-len",
    )
    add(
        "--draft-model",
        type=draft_model,
        default=None,
        metavar="SPEC",
        help="the model a model-based method drafts with, MODEL[:layers=N] (e.g. smollm2:layers=4: the first 4 "
        f"layers); implies --spec-method {DEFAULT_MODEL_METHOD}",
    )
    add(
        "--ngram-min",
        type=Bounded(int, ge=1, le=MAX_SPEC_LEN),
        default=None,
        metavar="N",
        help="prompt lookup (--spec-method ngram): shortest n-gram it matches (1)",
    )
    add(
        "--ngram-max",
        type=Bounded(int, ge=1, le=MAX_SPEC_LEN),
        default=None,
        metavar="N",
        help="prompt lookup (--spec-method ngram): longest n-gram it matches (3)",
    )
    suffix = "suffix decoding (--spec-method suffix, vLLM's speculative_config field of the same name): "
    add(
        "--suffix-decoding-max-tree-depth",
        type=Bounded(int, ge=2, le=MAX_SUFFIX_TREE_DEPTH),
        default=None,
        metavar="N",
        help=suffix + "the longest substring its suffix trees hold; a match is at most N - 1 ids (24)",
    )
    add(
        "--suffix-decoding-max-cached-requests",
        type=Bounded(int, ge=0, le=MAX_SUFFIX_CACHED_REQUESTS),
        default=None,
        metavar="N",
        help=suffix + "how many requests' outputs the global tree holds, oldest evicted first; 0: none (10000)",
    )
    add(
        "--suffix-decoding-max-spec-factor",
        type=NUMBER,
        default=None,
        metavar="X",
        help=suffix + "a match of m ids drafts at most X * m ids (1.0)",
    )
    add(
        "--suffix-decoding-min-token-prob",
        type=NUMBER,
        default=None,
        metavar="P",
        help=suffix + "a guess whose estimated probability falls below P ends the draft (0.1)",
    )
    add(
        "--eagle-head",
        default=None,
        metavar="DIR",
        help="an EAGLE head (--spec-method eagle): the directory `mechserve train-draft` wrote (default: the one "
        "it wrote for the loaded model in $MECHSERVE_CACHE/eagle)",
    )
    add(
        "--eagle-draft-vocab",
        type=Bounded(int, ge=0, le=1 << 30),
        default=None,
        metavar="N",
        help="an EAGLE head (--spec-method eagle) chooses among the N ids most frequent in its training outputs "
        "(FR-Spec); 0: the whole vocabulary (0)",
    )
    add(
        "--spec-fixed",
        action="store_true",
        help="every decode step carries --spec-len guesses (default: fewer, down to none, when they do not pay)",
    )


def draft_model(text: str) -> str:
    """An argparse ``type=`` for ``--draft-model``: ``MODEL[:layers=N]``."""
    from mechserve.api.config import parse_draft_model

    try:
        parse_draft_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def stop_text(text: str) -> str:
    """An argparse ``type=`` for ``--stop``: any text but the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (vLLM's ``SamplingParams`` fields); their ranges are checked by ``sampling_params``."""
    add = parser.add_argument
    add(
        "--temperature",
        type=NUMBER,
        default=0.0,
        metavar="T",
        help="sampling temperature (default 0: greedy, so the same command gives the same text; "
        "the Python API's default is vLLM's 1.0)",
    )
    add("--top-p", type=NUMBER, default=1.0, metavar="P", help="nucleus sampling: keep the top tokens of mass P")
    add(
        "--top-k",
        type=Bounded(int, ge=-1, le=1 << 31),
        default=0,
        metavar="K",
        help="keep the K most likely tokens (0: off)",
    )
    add("--min-p", type=NUMBER, default=0.0, metavar="P", help="drop tokens below P x the top probability")
    add(
        "--seed",
        type=Bounded(int, ge=-(1 << 63), le=(1 << 63) - 1),
        default=None,
        metavar="N",
        help="seed of this request's draws, any 64-bit signed integer; -1: unseeded (as the server's seed field)",
    )
    add(
        "--stop",
        type=stop_text,
        action="append",
        default=[],
        metavar="TEXT",
        help="a stop string, not included in the text (repeatable; a newline is $'\\n' in bash)",
    )
    add(
        "--stop-token-id",
        type=Bounded(int, ge=0, le=(1 << 31) - 1),
        action="append",
        default=[],
        metavar="ID",
        help="a token id that ends the output (repeatable)",
    )
    add("--ignore-eos", action="store_true", help="treat the model's EOS as an ordinary token")
    add(
        "--min-tokens",
        type=Bounded(int, ge=0, le=MAX_NEW_TOKENS),
        default=0,
        metavar="N",
        help="no EOS or stop before N tokens",
    )
    add(
        "--logprobs",
        type=Bounded(int, ge=0, le=MAX_LOGPROBS),
        default=None,
        metavar="N",
        help="show each token's log-probability and the top N alternatives",
    )
    add(
        "--n", type=Bounded(int, ge=1, le=MAX_SAMPLES), default=1, metavar="N", help="independent samples of the prompt"
    )


# SamplingParams field -> the flag that sets it, for error messages.
_PARAM_FLAGS = {
    "n": "--n",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "max_tokens": "--max-tokens",
    "min_tokens": "--min-tokens",
    "stop_token_ids": "--stop-token-id",
    "stop": "--stop",
    "logprobs": "--logprobs",
}


def sampling_params(args: argparse.Namespace) -> Any:
    """The request's ``SamplingParams`` from the flags; raises ``CliError`` naming the flag of a bad value."""
    from mechserve.api.params import SamplingParams

    try:
        return SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=None if args.seed == -1 else args.seed,  # the HTTP seed field's rule (vLLM's, llama.cpp's)
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            stop=tuple(args.stop),
            stop_token_ids=tuple(args.stop_token_id),
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise CliError(f"{_PARAM_FLAGS[field]}: {rest}" if field in _PARAM_FLAGS else str(exc)) from None


DTYPES = ("float32", "bfloat16", "float16")


QUANTIZATIONS = engine_settings.QUANTIZATIONS


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` (the weights', activations' and KV cache's dtype) and ``--quantization`` (the weight
    matrices in GGUF blocks); shared with ``serve``."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights, activations and KV cache (default float32, the mode checked against transformers)",
    )
    add_quantization_argument(parser)


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """``--quantization``: keep the weight matrices in GGUF's Q4_1 or Q8_0 blocks (``EngineConfig.quantization``)."""
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="keep the weight matrices in GGUF blocks and multiply them as they are (q4_1: the embedded "
        "model's own file); activations and KV cache stay in --dtype (float32 or bfloat16); one rank only",
    )


def load(model: str, dtype: str | None, world_size: int = 1, quantization: str | None = None) -> Any:
    """``load_model(model)`` in ``dtype`` (default float32) and ``quantization``, its weights only for one
    rank (with more, the ranks load their shards); ``ModelLoadError`` propagates.  The flags' combination
    is checked before (``engine_config``)."""
    import torch

    from mechserve.model.loader import load_model

    return load_model(
        model, dtype=getattr(torch, dtype or "float32"), weights=world_size == 1, quantization=quantization
    )


def check_arguments(args: argparse.Namespace) -> None:
    """The checks that span several flags, before the model is loaded (the engine's settings as one
    ``EngineConfig``: ``engine_config``); raises ``CliError``."""
    engine_config(args, ignore=("seed",))
    if args.chat_template is not None and not args.chat:
        raise CliError("--chat-template applies to --chat (the prompt as a user message); add --chat")


def run(args: argparse.Namespace) -> int:
    """Run ``generate``; returns 0.

    Raises ``CliError`` (one line, exit status 2) for a bad argument, a model
    that cannot be loaded, a KV cache that does not fit, a request the door
    rejects, or an engine failure part-way (after the steps before it are
    printed).
    """
    check_arguments(args)
    params = sampling_params(args)
    viz = VizOutputs.from_args(args)
    from mechserve.api.errors import (
        KVMemoryError,
        ModelLoadError,
        NativeKernelError,
        RankError,
        RequestRejected,
        first_line,
    )
    from mechserve.engine.core import EngineCore
    from mechserve.engine.executors import configure_threads

    try:
        configure_threads()
        loaded = load(args.model, args.dtype, args.world_size, args.quantization)
        apply_chat_template_flag(loaded.tokenizer, args.chat_template)
        prompt, ids = prompt_ids(loaded.tokenizer, args.prompt, args.chat)
        core = EngineCore(loaded, sized_config(args, loaded.model, len(ids)), keep_finished=True)
        request_id = core.add_request(ids, params, request_id="r0", prompt=prompt)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except KVMemoryError as exc:
        raise CliError(kv_message(exc)) from None
    except RequestRejected as exc:
        hint = REJECT_HINTS.get(exc.reason.value, "see mech-notes/12-admission-control.md")
        raise CliError(f"request rejected: {exc.reason.value} ({exc.detail}; {hint})") from None
    except (ValueError, RankError, NativeKernelError) as exc:
        raise CliError(first_line(exc)) from None
    recorder = viz.recorder(core.scheduler.spec_engine, f"generate · model {args.model}", _decoder(core.tokenizer))
    clock = Clock()
    console = Console(highlight=False, soft_wrap=True)
    show = (lambda record: None) if args.quiet else _print_json if args.json else _print_trace(console)

    failed: dict[str, Exception] = {}

    def seen(out: Any) -> None:
        clock.step(out.record)
        show(out.record)
        failed.update(out.failed)
        if recorder is not None:
            recorder(out.record)

    try:
        finished = core.run_until_idle(seen)
    except Exception as exc:  # an engine or executor failure part-way: the steps so far are printed (D3)
        core.close()
        raise CliError(step_failure(exc, core.step_counter)) from exc
    clock.stop()
    if request_id in failed:  # it failed alone inside a step (its logits processing): one line, no traceback
        core.close()
        raise CliError(first_line(failed[request_id]))
    (done,) = [o for o in finished if o.request_id == request_id]
    try:
        print_result(args, console, core, done, clock, prompt)
    finally:
        core.close()
    viz.write(recorder, core.summary(), [output_json(done.request_id, c) for c in done.outputs])
    return 0


def _decoder(tokenizer: Any) -> Callable[[Any], str] | None:
    """Token ids to text for the viewer (special tokens dropped), or None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


def sized_config(args: argparse.Namespace, model: Any, prompt_len: int) -> Any:
    """The ``EngineConfig`` the flags ask for (``engine_config``); without ``--num-pages`` or ``--kv-memory``
    the pool is sized for this request's samples (capped at ``DEFAULT_KV_BYTES``)."""
    from mechserve.api.config import DEFAULT_KV_BYTES
    from mechserve.engine.pool import auto_num_pages, model_context, page_bytes

    pages = auto_num_pages(
        [prompt_len] * args.n, args.max_tokens, args.page_size, model, DEFAULT_KV_BYTES, model_context(model)
    )
    return engine_config(args, ignore=("seed",), max_kv_bytes=pages * page_bytes(model, args.page_size))


def prompt_ids(tokenizer: Any, text: str, chat: bool) -> tuple[str, list[int]]:
    """The prompt's text and ids: raw, or with ``chat`` the chat template around one user message.

    Raises ``ValueError`` without a tokenizer, or with ``chat`` and no chat template.
    """
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, so it cannot take a text prompt")
    if not chat:
        return text, list(tokenizer(text).input_ids)
    from mechserve.entrypoints.prompts import apply_chat_template

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "--chat: the model has no chat template; give one with --chat-template FILE_OR_TEMPLATE, or drop --chat"
        )
    templated = apply_chat_template(tokenizer, [{"role": "user", "content": text}], True, None)
    return templated, list(tokenizer(templated, add_special_tokens=False).input_ids)


def print_result(args: argparse.Namespace, console: Console, core: Any, done: Any, clock: Clock, prompt: str) -> None:
    """The outputs: JSON (summary and outputs), only the text (``--quiet``) or prompt, text and timing."""
    if args.json:
        outputs = [output_json(done.request_id, c) for c in done.outputs]
        print(json.dumps({"summary": summary(core, done), "outputs": outputs}), flush=True)
        return
    if args.quiet:
        sys.stdout.write("".join(c.text + "\n" for c in done.outputs))
        sys.stdout.flush()
        return
    shown = args.prompt + "\n" if args.chat else args.prompt
    for c in done.outputs:
        lead = Text(f"[{c.index}] ", style="cyan") if len(done.outputs) > 1 else Text("")
        console.print(lead + Text(shown, style="dim") + Text(c.text, style="bold"))
        if c.logprobs is not None:
            for line in logprob_lines(c.token_ids, c.logprobs):
                console.print(Text(line, style="dim"))
    generated = sum(len(c.token_ids) for c in done.outputs)
    reasons = ", ".join(finish_text(c) for c in done.outputs)
    console.print(Text(clock.report(len(done.prompt_token_ids), generated, reasons), style="dim"))
    if core.speculative is not None:
        stats = core.stats(executor=True).executor
        console.print(Text(speculation_report(core.speculative.method, stats), style="dim"))


def speculation_report(method: str, stats: Any) -> str:
    """``speculation (ngram): 25 of 43 guesses accepted (58%), 2.6 tokens per decode forward``."""
    rate = f" ({stats.accepted / stats.proposed:.0%})" if stats.proposed else ""
    per = stats.emitted / stats.windows if stats.windows else 0.0
    return (
        f"speculation ({method}): {stats.accepted} of {stats.proposed} guesses accepted{rate}, "
        f"{per:.2f} tokens per decode step"
    )


def finish_text(c: Any) -> str:
    """``length``, ``stop (EOS)``, ``stop (id 42)`` or ``stop ('\\n\\n')``."""
    if c.finish_reason != "stop":
        return str(c.finish_reason)
    if c.stop_reason is None:
        return "stop (EOS)"
    if isinstance(c.stop_reason, int):
        return f"stop (id {c.stop_reason})"
    return f"stop ({c.stop_reason!r})"


def output_json(request_id: str, c: Any) -> dict[str, Any]:
    """One sample as JSON: id, text, ids, finish (vLLM's names), then the index and logprobs if asked for.

    ``logprobs`` is vLLM's ``CompletionOutput.logprobs`` as JSON: one object per token id, mapping
    each id (the chosen one first, then the top N) to ``{"logprob", "rank", "decoded_token"}``.
    """
    out: dict[str, Any] = {
        "request_id": request_id,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "index": c.index,
    }
    if c.logprobs is not None:
        out["logprobs"] = [
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in c.logprobs
        ]
        out["cumulative_logprob"] = c.cumulative_logprob
    return out


def logprob_lines(token_ids: Any, logprobs: Any) -> list[str]:
    """One line per token: its text, log-probability, rank and the top alternatives (vLLM's shape in)."""
    lines = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        alternatives = sorted((t for t in entry if t != token_id), key=lambda t: entry[t].rank or 0)
        top = "  ".join(f"{entry[t].decoded_token!r} {entry[t].logprob:.3f}" for t in alternatives)
        line = f"  {chosen.decoded_token!r:>16} {chosen.logprob:8.3f}  rank {chosen.rank}"
        lines.append(f"{line}  top: {top}" if top else line)
    return lines


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


def summary(core: Any, done: Any) -> list[dict[str, Any]]:
    """The engine's summary, each sample a stop string ended marked with ``"stop_string"``.

    A stop string is found in detokenized text, after the scheduler's step (as in vLLM, whose
    output processor finishes such requests in the engine core); the summary says
    ``FINISHED``/``STOP`` and ``stop_string`` says which string.
    """
    entries = core.summary()
    stopped = {
        (done.request_id if len(done.outputs) == 1 else f"{done.request_id}#{c.index}"): c.stop_reason
        for c in done.outputs
        if isinstance(c.stop_reason, str)
    }
    for entry in entries:
        if entry["finish_reason"] == "STOP" and entry["request_id"] in stopped:
            entry["stop_string"] = stopped[entry["request_id"]]
    return entries


def step_failure(exc: BaseException, step_counter: int) -> str:
    """The error line for a failure inside an engine step: ``run``'s wording, or out of memory."""
    from mechserve.api.errors import first_line, is_allocation_failure

    if is_allocation_failure(exc):
        return (
            f"out of memory during step {step_counter}: {first_line(exc)}; "
            "lower --max-step-tokens (the prefill chunk) or --num-pages"
        )
    return engine_failure(exc, step_counter)


class Clock:
    """Times one request: from the first step to its first sampled token (prefill), then to the end (decode)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first: float | None = None
        self.ended: float | None = None
        self.steps = 0

    def step(self, record: m16.StepRecord) -> None:
        """Count a step; its end is the first token's time if it is the first to sample."""
        self.steps += 1
        if self.first is None and record.tokens:
            self.first = time.perf_counter()

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


def _print_json(record: m16.StepRecord) -> None:
    print(json.dumps(record.to_json()), flush=True)


def _print_trace(console: Console) -> Callable[[m16.StepRecord], None]:
    return lambda record: console.print(_trace_line(record))


def _trace_line(record: m16.StepRecord) -> Text:
    """One step as ``step N  scheduled ..  executed r=n  sampled r=TOKEN ...``; empty fields left out."""
    line = Text(f"step {record.step:>3}", style="bold")
    fields: list[tuple[str, Any]] = [
        ("scheduled", " ".join(record.scheduled)),
        ("executed", _pairs(record.executed)),
        ("sampled", _pairs({k: v.value for k, v in record.sampled.items()})),
        ("finished", _pairs({k: v.value for k, v in record.finished.items()})),
        ("preempted", " ".join(record.preempted)),
        ("reused", _pairs(record.reused)),
        ("rejected", " ".join(f"{k}={reason.value}" for k, reason in record.rejected)),
        ("aborted", " ".join(record.aborted)),
    ]
    if any(record.drafted.values()):
        fields.append(("accepted", _pairs({k: f"{record.accepted[k]}/{d}" for k, d in record.drafted.items()})))
    for name, value in fields:
        if value:
            line += Text(f"  {name} ", style="cyan") + Text(value)
    return line


def _pairs(mapping: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in mapping.items())
