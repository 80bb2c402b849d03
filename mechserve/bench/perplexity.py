"""``mechserve bench perplexity``: perplexity of a local text per mode, beside llama.cpp's ``llama-perplexity``.

::

    mechserve bench perplexity [--mode exact,fast,q4_1,q8_0] [--engine mechserve,llama-cpp] [--ctx 256]
                               [--rows N] [--text FILE] [--model M] [--out DIR]

The text (default: the Declaration of Independence, public domain, shipped in ``bench/data``) is
tokenized as ``llama-perplexity`` tokenizes it (a BOS first if the tokenizer adds one, and then each chunk's
first token replaced by BOS) and cut into chunks of ``ctx`` tokens.  As ``llama-perplexity`` does,
each chunk is one forward from an empty context and only its second half is scored: the negative
log-likelihood of token ``i + 1`` from the logits at ``i`` for ``ctx/2 <= i < ctx - 1``; the
perplexity is ``exp`` of their mean over every chunk.  mechserve runs the chunk through its own
forward (paged KV, the mode's kernels), in one forward or ``--rows`` tokens at a time: the row count
picks the kernel path a decode step of that many rows takes (``linear.native_max_rows``; up to a
format's few rows, 3, q4_1/q8_0 are multiplied on their exact blocks, above that in bfloat16 tiles, and
above 256 rows dequantized for torch's GEMM; a GGUF K-quant on its blocks up to 16 rows).
llama.cpp runs ``llama-perplexity -c ctx`` on the mode's GGUF (``llama_cpp.MODE_GGUF``) when it is found.
``--model FILE.gguf``: mechserve runs the file as it stores its weights (mode exact: float32 activations,
fast: bfloat16) and llama.cpp the same file.  Where ``llama-tokenize`` is found, the text's ids from it and
from mechserve's tokenizer are compared (``tokenizer`` in the JSON: both counts and the first difference).
``DIR/perplexity.json`` holds every number; one line per (engine, mode) goes to stdout.  The top level
imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mechserve.model.protocol import Model

DEFAULT_TEXT = Path(__file__).with_name("data") / "declaration-of-independence.txt"
ENGINES = ("mechserve", "llama-cpp")
MODES = ("exact", "fast", "q4_1", "q8_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mechserve.cli.parser import names

    add = parser.add_argument
    add("--mode", type=names("mode", MODES), default=list(MODES), help="comma-separated (default all four)")
    add("--engine", type=names("engine", ENGINES), default=list(ENGINES), help="mechserve, llama-cpp or both")
    add(
        "--ctx",
        type=int,
        default=256,
        help="tokens per chunk (default 256, as the llama.cpp run in docs/benchmarks.md)",
    )
    add(
        "--rows",
        type=int,
        default=None,
        help="tokens per forward (default: the whole chunk): the kernels a decode step of that many rows uses",
    )
    add("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file (default: the shipped public-domain text)")
    add(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded, default), a local Hugging Face model directory or a GGUF file (modes exact, fast)",
    )
    add("--out", type=Path, default=Path("bench-results"), help="directory for perplexity.json")


def chunk_scores(logits_rows: Any, tokens: Any, ctx: int) -> tuple[float, int]:
    """Sum of negative log-likelihoods and count for one chunk: ``logits_rows`` [ctx, V] float32 logits at
    every position, ``tokens`` [ctx] int64; positions ``ctx/2 .. ctx - 2`` predict the next token (as
    ``llama-perplexity``'s ``first = n_ctx/2``)."""
    import torch

    first = ctx // 2
    logp = torch.log_softmax(logits_rows[first : ctx - 1].double(), dim=-1)
    target = tokens[first + 1 : ctx]
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    return float(nll.sum()), int(nll.numel())


def chunk_pieces(ctx: int, rows: int | None) -> list[tuple[int, int]]:
    """``(start, num_tokens)`` of each forward that covers one chunk of ``ctx`` tokens, ``rows`` at a time
    (None: the whole chunk in one forward)."""
    step = ctx if rows is None else rows
    return [(s, min(step, ctx - s)) for s in range(0, ctx, step)]


def mechserve_perplexity(
    model: Model, ids: list[int], ctx: int, rows: int | None = None, bos: int | None = None
) -> dict[str, Any]:
    """Perplexity of ``ids`` under ``model`` (a ``model.protocol.Model``) in chunks of ``ctx`` (module docstring).

    ``rows``: tokens per forward, continuing the chunk's paged KV (None: the chunk in one forward).
    ``bos``: each chunk's first token is this id (llama-perplexity's rule when the vocabulary adds a BOS).
    Each forward takes the path a step of that many rows takes (``linear.native_max_rows``), so a
    small ``rows`` scores the quantized modes on the kernels decode uses rather than on weights
    dequantized for torch's GEMM.
    Raises ``ValueError`` when ``ids`` is shorter than one chunk.
    """
    import torch

    from mechserve.kv.paged import Span, build_attention_batch

    chunks = len(ids) // ctx
    if chunks < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    page = 16
    pages = -(-ctx // page)
    g = model.arch.num_heads // model.arch.num_kv_heads
    table = list(range(pages))  # identity page table: slot == position
    pieces = [
        (
            s,
            n,
            build_attention_batch(
                [Span(0, s, n, table)], list(range(s, s + n)), page, g, model.distinct_sliding_windows
            ),
        )
        for s, n in chunk_pieces(ctx, rows)
    ]
    total, count = 0.0, 0
    start = time.perf_counter()
    for c in range(chunks):
        tokens = torch.tensor(ids[c * ctx : (c + 1) * ctx], dtype=torch.int64)
        if bos is not None:
            tokens[0] = bos
        cache = model.new_cache(pages, page)
        logits = torch.cat(
            [model.forward(tokens[s : s + n], torch.arange(s, s + n), cache, batch, None) for s, n, batch in pieces]
        )  # [ctx, V] float32
        s_, n_ = chunk_scores(logits, tokens, ctx)
        total, count = total + s_, count + n_
    return {
        "perplexity": math.exp(total / count),
        "chunks": chunks,
        "scored_tokens": count,
        "rows_per_forward": rows or ctx,
        "seconds": time.perf_counter() - start,
    }


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def parse_llama_perplexity(output: str) -> tuple[float, float] | None:
    """``(ppl, error)`` from ``llama-perplexity``'s "Final estimate: PPL = X +/- Y" line, or None."""
    m = _FINAL.search(output)
    return (float(m.group(1)), float(m.group(2))) if m else None


def llama_perplexity(mode: str, text: Path, ctx: int, threads: int, gguf: Path | None = None) -> dict[str, Any]:
    """``llama-perplexity`` on ``gguf`` (default the mode's GGUF of the embedded model); raises ``OSError`` when
    it is missing or fails."""
    from mechserve.bench import llama_cpp

    tool = llama_cpp.find_tool("llama-perplexity")
    if tool is None:
        raise OSError("llama-perplexity not found beside llama-server (make llama-cpp builds it)")
    gguf = gguf or llama_cpp.ensure_gguf(llama_cpp.MODE_GGUF[mode])
    cmd = [str(tool), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads), "-b", str(ctx)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = parse_llama_perplexity(done.stdout + done.stderr)
    if done.returncode or found is None:
        raise OSError(f"llama-perplexity failed ({done.returncode}): {(done.stderr or done.stdout)[-300:]}")
    return {"perplexity": found[0], "error": found[1], "gguf": gguf.name, "seconds": time.perf_counter() - start}


def llama_tokenize(gguf: Path, text: Path) -> list[int]:
    """The ids ``llama-tokenize`` gives ``text`` with ``gguf``'s vocabulary (a BOS first if it adds one, special
    tokens parsed, as llama-perplexity tokenizes).  Raises ``OSError`` when it is missing or fails."""
    from mechserve.bench import llama_cpp

    tool = llama_cpp.find_tool("llama-tokenize")
    if tool is None:
        raise OSError("llama-tokenize not found beside llama-server (make llama-cpp builds it)")
    cmd = [str(tool), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode or not lines:
        raise OSError(f"llama-tokenize failed ({done.returncode}): {(done.stderr or done.stdout)[-300:]}")
    return [int(t) for t in json.loads(lines[-1])]


def compare_ids(ours: list[int], theirs: list[int]) -> dict[str, Any]:
    """Both id lists' lengths, whether they are identical and where they first differ (None if nowhere)."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    return {
        "mechserve": len(ours),
        "llama_tokenize": len(theirs),
        "identical": ours == theirs,
        "first_difference": first,
    }


def run(args: argparse.Namespace) -> int:
    from mechserve.cli.errors import CliError

    if args.ctx < 8 or args.ctx % 2:
        raise CliError(f"--ctx must be an even number >= 8, got {args.ctx}")
    if args.rows is not None and not 1 <= args.rows <= args.ctx:
        raise CliError(f"--rows must be between 1 and --ctx ({args.ctx}), got {args.rows}")
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--text: cannot read {args.text}: {exc}") from None
    try:
        doc = perplexities(args, text)
    except (OSError, ValueError) as exc:
        raise CliError(f"bench perplexity: {exc}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "perplexity.json").write_text(json.dumps(doc, indent=1))
    print(f"results: {args.out / 'perplexity.json'}", file=sys.stderr)
    return 0


def perplexities(args: argparse.Namespace, text: str) -> dict[str, Any]:
    """Every (engine, mode) perplexity the arguments ask for; llama.cpp is skipped with one line when absent."""
    import torch

    from mechserve.bench import llama_cpp
    from mechserve.bench.run import _loadavg, machine
    from mechserve.bench.runners import MODES as MODE_DTYPES
    from mechserve.engine.executors import configure_threads
    from mechserve.model.gguf_file import is_gguf
    from mechserve.model.loader import load_model

    threads = configure_threads()
    doc: dict[str, Any] = {"machine": machine(), "text": str(args.text), "ctx": args.ctx, "runs": [], "skipped": []}
    gguf = Path(args.model) if is_gguf(args.model) else None
    if gguf is not None and any(MODE_DTYPES[m][1] is not None for m in args.mode):
        raise ValueError("a GGUF file runs its weights as it stores them; choose --mode exact or fast")
    ids: list[int] | None = None
    bos: int | None = None
    for mode in args.mode:
        dtype, quantization = MODE_DTYPES[mode]
        if "mechserve" in args.engine:
            loaded = load_model(str(args.model), dtype=dtype, quantization=quantization)
            if ids is None:
                assert loaded.tokenizer is not None  # load_model(tokenizer=True)
                ids = list(loaded.tokenizer(text).input_ids)  # a BOS first if the vocabulary adds one
                tok_bos = loaded.tokenizer.bos_token_id
                bos = tok_bos if ids and tok_bos is not None and ids[0] == tok_bos else None
                doc["tokens"] = len(ids)
                _compare_tokenizers(doc, ids, args, gguf)
            with torch.inference_mode():
                r = mechserve_perplexity(loaded.model, ids, args.ctx, args.rows, bos)
            doc["runs"].append({"engine": "mechserve", "mode": mode, **r})
            print(
                f"perplexity mechserve {mode:5s} {r['perplexity']:.4f} "
                f"({r['scored_tokens']} tokens scored, {r['rows_per_forward']} rows per forward)",
                flush=True,
            )
        if "llama-cpp" in args.engine:
            reason = (
                llama_cpp.missing_message()
                if args.model == "smollm2" or gguf is not None
                else "llama-cpp skipped: the embedded model or a GGUF file only"
            )
            if reason is None:
                try:
                    r = llama_perplexity(mode, args.text, args.ctx, threads, gguf)
                except OSError as exc:
                    reason = f"llama-cpp skipped: {exc}"
                else:
                    doc["runs"].append({"engine": "llama-cpp", "mode": mode, **r})
                    print(f"perplexity llama-cpp {mode:5s} {r['perplexity']:.4f} +/- {r['error']:.4f}", flush=True)
            if reason is not None and reason not in {s["reason"] for s in doc["skipped"]}:
                print(reason, file=sys.stderr)
                doc["skipped"].append({"engine": "llama-cpp", "reason": reason})
    doc["machine"]["load_average_at_end"] = _loadavg()
    return doc


def _compare_tokenizers(doc: dict[str, Any], ids: list[int], args: argparse.Namespace, gguf: Path | None) -> None:
    """``doc["tokenizer"]``: mechserve's ids of the text against ``llama-tokenize``'s with the GGUF llama.cpp runs
    (the embedded model's shipped file, or ``gguf``), when llama.cpp is asked for and found; one line on stdout."""
    from mechserve.bench import llama_cpp

    if "llama-cpp" not in args.engine or (gguf is None and args.model != "smollm2"):
        return
    try:
        theirs = llama_tokenize(gguf or llama_cpp.ensure_gguf("q4_1"), args.text)
    except OSError as exc:
        doc["tokenizer"] = {"skipped": str(exc)}
        return
    doc["tokenizer"] = compare_ids(ids, theirs)
    t = doc["tokenizer"]
    said = "identical" if t["identical"] else f"differ from index {t['first_difference']}"
    print(f"tokenizer: mechserve {t['mechserve']} ids, llama-tokenize {t['llama_tokenize']} ids: {said}", flush=True)
