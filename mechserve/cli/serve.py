"""``mechserve serve``: the OpenAI-compatible HTTP server (``mechserve.http``) in the foreground.

Importing this module is cheap (no torch, no FastAPI); ``run`` imports them.
The model is loaded and the KV cache allocated before the socket is bound,
so a bad model, size or address is one ``mechserve: error: ...`` line and
exit status 2, never a half-started server.  An engine that dies while serving (a tensor-parallel
rank killed) makes ``/health`` and new requests 503 and the server stop with exit status 1, so that
a supervisor restarts it.  Ctrl-C (SIGINT) or SIGTERM
stops it: new requests are refused and every request in flight is aborted at
once, so that each response still ends as the protocol says (a stream with a
``finish_reason: "abort"`` chunk and ``data: [DONE]``, a non-streaming request
with an OpenAI-style 503), with no traceback; then the exit status is 0.

``vllm serve``'s spellings work beside ours (``mechserve.cli.vllm_names``): the positional model,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``, ``--tensor-parallel-size``/``-tp``,
``--[no-]enable-prefix-caching`` and ``--chat-template``; one setting given under both names with
two values is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import signal
import sys
from typing import Any

from mechserve.api.config import DEFAULT_MAX_RUNNING, DEFAULT_MAX_STEP_TOKENS, DEFAULT_PAGE_SIZE
from mechserve.api.limits import (
    CLIENT_TIMEOUT_S,
    MAX_REQUEST_BYTES,
    RENDER_MEMORY_BYTES,
    RENDER_TIMEOUT_S,
)
from mechserve.api.proposers import proposer_method
from mechserve.cli.engine_args import engine_config, setting
from mechserve.cli.errors import CliError
from mechserve.cli.generate import add_dtype_argument, add_speculative_arguments, kv_message, parse_size
from mechserve.cli.parser import Bounded, add_device_arguments, api_key
from mechserve.cli.vllm_names import (
    add_aliased,
    add_chat_template_argument,
    add_model_argument,
    add_prefix_caching_arguments,
    apply_chat_template_flag,
    resolve,
)

HELP = "serve a model over an OpenAI-compatible HTTP API (needs the serve extra)"
API_KEY_ENV = "MECHSERVE_API_KEY"
# A server bounds its queue: more waiting requests get 429 (an offline LLM batch has no such bound).
DEFAULT_MAX_WAITING = 256
SERVE_MAX_STEP_TOKENS = 512  # prefill chunks interleaved with decodes keep inter-token latency low
GRACEFUL_SHUTDOWN_SECONDS = 5  # for connections still open after the drain (a client that reads slowly)
DEFAULT_STORED_RESPONSES = 1024  # mechserve.http.responses_api.MAX_STORED_RESPONSES (not imported: no FastAPI here)
MAX_STORED_RESPONSES_LIMIT = 1_000_000
MAX_DATA_PARALLEL = 256
ROUTING_POLICIES = ("precise", "cache_aware", "round_robin", "least_loaded")  # mechserve.dp.client.POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags; sizes are checked by their ``type=`` before anything is loaded."""
    add = parser.add_argument
    add_model_argument(parser, "'smollm2' (embedded, default), a local Hugging Face model directory or a GGUF file")
    add("--served-model-name", default=None, metavar="NAME", help="the name clients use (default: --model)")
    add_dtype_argument(parser)
    add_device_arguments(parser)
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=Bounded(int, ge=0, le=65535), default=8000, help="port to bind (default 8000; 0: any free port)")
    add(
        "--api-key",
        type=api_key(API_KEY_ENV),
        default=os.environ.get(API_KEY_ENV),  # a string default goes through ``type=`` too: an empty one is refused
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV})",
    )
    add(
        "--max-request-bytes",
        type=parse_size,
        default=MAX_REQUEST_BYTES,
        metavar="SIZE",
        help="the largest request body (default 4MiB); a larger one is a 413 before it is read",
    )
    add(
        "--max-stored-responses",
        type=Bounded(int, ge=1, le=MAX_STORED_RESPONSES_LIMIT),
        default=DEFAULT_STORED_RESPONSES,
        metavar="N",
        help=f"/v1/responses keeps the newest N responses in memory for GET and previous_response_id "
        f"(default {DEFAULT_STORED_RESPONSES})",
    )
    add_aliased(
        parser,
        "--max-running",
        ("--max-num-seqs",),
        dest="max_running",
        default=DEFAULT_MAX_RUNNING,
        type=setting("max_running"),
        metavar="N",
        help=f"requests running at once (default {DEFAULT_MAX_RUNNING}); the rest wait",
    )
    add(
        "--max-waiting",
        type=setting("max_waiting"),
        default=DEFAULT_MAX_WAITING,
        metavar="N",
        help=f"requests that may wait (default {DEFAULT_MAX_WAITING}); beyond it requests get 429 and Retry-After",
    )
    add_aliased(
        parser,
        "--max-step-tokens",
        ("--max-num-batched-tokens",),
        dest="max_step_tokens",
        default=SERVE_MAX_STEP_TOKENS,
        type=setting("max_step_tokens"),
        metavar="N",
        help=f"per-step token budget, the prefill chunk (default {SERVE_MAX_STEP_TOKENS}; generate's is "
        f"{DEFAULT_MAX_STEP_TOKENS})",
    )
    add_aliased(
        parser,
        "--page-size",
        ("--block-size",),
        dest="page_size",
        default=DEFAULT_PAGE_SIZE,
        type=setting("page_size"),
        metavar="N",
        help=f"KV positions per page (default {DEFAULT_PAGE_SIZE})",
    )
    add("--num-pages", type=setting("num_pages"), default=None, metavar="N", help="KV pages")
    add(
        "--kv-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="a KV budget such as 512MiB that sizes the pool",
    )
    add(
        "--spec-len",
        type=setting("spec_len"),
        default=None,
        metavar="K",
        help="speculative decoding: at most K guesses per decode step (default 0: off; 3 with --spec-method)",
    )
    add_speculative_arguments(parser)
    add("--max-model-len", type=setting("max_model_len"), default=None, metavar="N", help="longest prompt + output")
    add_prefix_caching_arguments(parser)
    add(
        "--no-output-caching",
        action="store_true",
        help="publish prompt pages only: a conversation's next turn then computes the previous answer again "
        "(by default every full block of generated tokens is cached too)",
    )
    add(
        "--no-hold-shared-prefix",
        action="store_true",
        help="admit a request at once even while a running request is still computing the prompt prefix they "
        "share (by default it waits until that prefix is cached, so the prefix is computed once)",
    )
    add(
        "--seed",
        type=Bounded(int, ge=0, le=(1 << 63) - 1),
        default=0,
        metavar="N",
        help="seed of unseeded sampling requests",
    )
    add_aliased(
        parser,
        "--world-size",
        ("--tensor-parallel-size", "-tp"),
        dest="world_size",
        default=1,
        type=setting("world_size"),
        metavar="N",
        help="tensor-parallel rank processes (default 1)",
    )
    add(
        "--data-parallel-size",
        "-dp",
        dest="data_parallel_size",
        default=1,
        type=Bounded(int, ge=1, le=MAX_DATA_PARALLEL),
        metavar="N",
        help="engine-core processes behind this server, each a whole engine with its own KV pool and prefix "
        "cache on --threads/N threads, requests routed by --routing-policy (vLLM's flag; default 1: one engine "
        "in this process)",
    )
    add(
        "--routing-policy",
        choices=ROUTING_POLICIES,
        default=None,
        help="with --data-parallel-size > 1: how each request picks its replica (default precise: the replicas' "
        "KV events and load, llm-d's scorer; cache_aware: sgl-router's approximate tree; round_robin; "
        "least_loaded)",
    )
    add(
        "--threads",
        type=Bounded(int, ge=1, le=4096),
        default=None,
        metavar="T",
        help="CPU threads for the engine (default: every CPU this process may use, and at least one per replica); "
        "with --data-parallel-size N each replica gets T//N",
    )
    add(
        "--allow-additional-properties",
        action="store_true",
        help="structured outputs and forced tool calls follow JSON Schema's open objects: an object schema "
        "without additionalProperties allows other properties (by default it allows none, as vLLM's default "
        "grammar backend)",
    )
    add_chat_template_argument(parser, "/v1/chat/completions and chat /tokenize")
    add(
        "--kv-events-endpoint",
        type=kv_events_endpoint,
        default=None,
        metavar="ENDPOINT",
        help="publish the prefix cache's changes as vLLM's KV events (KVEventBatch, msgpack) on a ZeroMQ PUB "
        "socket bound here, e.g. tcp://*:5557 (docs/fleet.md, 'KV events: the schema'); default: off",
    )
    add("--kv-events-topic", default="", metavar="TOPIC", help="the KV events' ZeroMQ topic (vLLM's default '')")
    add(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent with a request (vLLM's flag; by default such a request is a 400), in a "
        f"sandbox process bounded to {RENDER_TIMEOUT_S:g} s and {RENDER_MEMORY_BYTES >> 20} MiB",
    )
    add(
        "--ignore-unknown-fields",
        action="store_true",
        help="accept and ignore request body keys the server does not know (by default each is a 400 naming it, "
        "with the closest known name); for proxies that add their own keys: each is logged once and named in "
        "the response header x-mechserve-ignored-fields",
    )
    add(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="encode special-token strings in chat messages (<|im_end|>) as the special tokens, as vLLM and "
        "llama-server do; by default they are text, so a message cannot forge a turn",
    )
    add(
        "--client-timeout",
        type=Bounded(float, gt=0, le=86_400, unit="seconds"),
        default=CLIENT_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request (head and body) has not arrived within this time, or whose "
        f"response the client has not read for this long (default {CLIENT_TIMEOUT_S:g})",
    )
    add(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning; info logs every request)",
    )


def kv_events_endpoint(text: str) -> str:
    """An argparse ``type=``: a ZeroMQ endpoint to bind, ``tcp://HOST:PORT`` (``*`` for every address) or
    ``ipc://PATH``."""
    scheme, _, rest = text.partition("://")
    host, _, port = rest.rpartition(":")
    if (scheme == "tcp" and host and port.isdigit() and 0 < int(port) < 65536) or (scheme == "ipc" and rest):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ endpoint such as tcp://*:5557")


def run(args: argparse.Namespace) -> int:
    """Load the model, bind, serve until stopped; returns 0.  Raises ``CliError`` for anything that stops it
    from starting (missing extra, bad model or size, a KV cache that does not fit, an address in use)."""
    resolve(args)
    engine_config(args)  # a bad value or combination of flags fails before anything loads
    check_data_parallel(args)
    uvicorn, server_module = _imports()
    events = _kv_events(args)
    try:
        return _serve(args, uvicorn, server_module, events)
    finally:
        if events is not None:
            events.publisher.close()


def check_data_parallel(args: argparse.Namespace) -> None:
    """``--data-parallel-size``, ``--routing-policy`` and ``--threads`` together; ``CliError`` for a combination
    that cannot run (checked before anything loads)."""
    size = args.data_parallel_size
    if size == 1:
        if args.routing_policy is not None:
            raise CliError("--routing-policy routes between data-parallel replicas: it needs --data-parallel-size > 1")
        return
    if args.world_size > 1:
        raise CliError("--data-parallel-size > 1 with --tensor-parallel-size > 1 is not supported: choose one")
    if args.threads is not None and args.threads < size:  # by default every replica gets at least one
        raise CliError(
            f"--threads {args.threads} is fewer than --data-parallel-size {size}: each replica needs at least one "
            "thread"
        )


def _kv_events(args: argparse.Namespace) -> Any:
    """The ``on_step`` hook publishing KV events (``mechserve.kv_events``), or None without the flag."""
    if args.kv_events_endpoint is None:
        return None
    try:
        from mechserve.kv_events import EnginePublisher, KVEventPublisher
    except ModuleNotFoundError as exc:
        raise CliError(f"--kv-events-endpoint needs {exc.name!r}: pip install 'mechserve[serve]'") from None
    try:
        publisher = KVEventPublisher(args.kv_events_endpoint, args.kv_events_topic)
    except ValueError as exc:
        raise CliError(f"--kv-events-endpoint: {exc}") from None
    return EnginePublisher(publisher)


def _serve(args: argparse.Namespace, uvicorn: Any, server_module: Any, events: Any) -> int:
    llm = _engine(args, events)
    if events is not None and args.data_parallel_size == 1:
        events.attach(llm.core)
    # What startup built (torch, transformers, the model) stays for the process's life: frozen out of the
    # collector, it is neither scanned by every full collection while serving (pauses) nor at exit, where
    # that scan took ~5 s on a loaded machine after the server had stopped (as vLLM does after startup).
    gc.collect()
    gc.freeze()
    name = args.served_model_name or args.model
    try:
        sock = server_module.bind_socket(args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot bind {args.host}:{args.port}: {exc.strerror or exc}") from None
    host, port = sock.getsockname()[:2]
    app = server_module.build_app(
        llm,
        model_name=name,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        max_stored_responses=args.max_stored_responses,
        ignore_unknown_fields=args.ignore_unknown_fields,
    )
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        http=server_module.guarded_protocol(args.client_timeout),
    )
    core = llm.core
    print(
        f"mechserve: serving {name!r} on http://{host}:{port} (OpenAI API under /v1; {_layout(args, llm)}, "
        f"max_running {args.max_running}, max_waiting {args.max_waiting}"
        f"{_speculation(core)}{', API key required' if args.api_key else ''}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn catches SIGINT and SIGTERM, shuts down (its Server drains the engine first: every request in
    # flight ends, a stream with an "abort" chunk and [DONE], a plain request with a 503), restores the
    # handlers it found and raises the signal again: to this one, so that SIGTERM, like Ctrl-C, ends here.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    server = server_module.Server(config)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if server.engine_error is not None:
        # a supervisor (systemd, Kubernetes) restarts a process that exits non-zero
        print(f"mechserve: error: the engine died ({server.engine_error}); exiting with status 1", file=sys.stderr)
        return 1
    print("mechserve: server stopped", file=sys.stderr, flush=True)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _layout(args: argparse.Namespace, llm: Any) -> str:
    """The startup line's engine part: one engine's memory, or the replicas, their threads and policy."""
    if args.data_parallel_size == 1:
        return describe_memory(llm.core)
    return (
        f"{llm.size} data-parallel replicas (pids {', '.join(map(str, llm.replica_pids()))}), "
        f"{llm.threads_each} thread(s) each, routing {llm.policy}; each: {llm.core.memory}"
    )


def describe_memory(core: Any) -> str:
    """issue 30: what the engine holds, for the startup line: ``weights 92.3 MiB (q4_1 64.0 MiB, ...), KV pool
    180.0 MiB: 720 pages of 16 positions (auto)`` (weights held by rank processes are not counted here)."""
    from mechserve.api.config import format_bytes
    from mechserve.model.memory import formats

    by_format = formats(core.model) if core.config.world_size == 1 else {}
    if by_format:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(by_format.items(), key=lambda kv: -kv[1]))
        weights = f"weights {format_bytes(sum(by_format.values()))} ({parts})"
    else:
        weights = f"weights on {core.config.world_size} ranks"
    return (
        f"{weights}, KV pool {format_bytes(core.kv_bytes)}: {core.num_pages} pages of {core.config.page_size} "
        f"positions ({core.sized_by})"
    )


def _speculation(core: Any) -> str:
    """``, speculative decoding: METHOD, up to K guesses`` for the startup line ('' when off)."""
    spec = core.speculative
    if spec is None:
        return ""
    method = proposer_method(spec.method)
    how = f"{method.summary} {spec.draft_model}" if method.needs_model else method.summary
    fixed = "" if spec.adaptive else ", fixed"
    return f", speculative decoding: {how}, up to {spec.num_speculative_tokens} guesses{fixed}"


def _imports() -> tuple[Any, Any]:
    """uvicorn and ``mechserve.http``; ``CliError`` naming the extra when one is missing."""
    try:
        import uvicorn

        import mechserve.http as server_module
    except ModuleNotFoundError as exc:
        extra = "torch" if exc.name in ("torch", "transformers", "safetensors") else "serve"
        raise CliError(f"serve needs {exc.name!r}: pip install 'mechserve[{extra}]'") from None
    return uvicorn, server_module


def _engine(args: argparse.Namespace, on_step: Any = None) -> Any:
    """The ``AsyncLLM`` the flags describe (model loaded, KV cache allocated, engine thread not started);
    ``on_step`` sees every step on the engine thread (the KV event publisher)."""
    from mechserve.api.errors import KVMemoryError, ModelLoadError, NativeKernelError
    from mechserve.entrypoints.async_llm import AsyncLLM

    resolve(args)
    llm: AsyncLLM
    try:
        if args.data_parallel_size > 1:
            from mechserve.dp.client import DataParallelLLM

            llm = DataParallelLLM(
                args.model,
                data_parallel_size=args.data_parallel_size,
                config=engine_config(args),
                model_name=args.served_model_name or args.model,
                routing_policy=args.routing_policy or "precise",
                threads=args.threads,
                kv_events=None if on_step is None else on_step.publisher,
            )
        else:
            if args.threads is not None:
                import torch

                torch.set_num_threads(args.threads)
            llm = AsyncLLM(
                args.model, config=engine_config(args), model_name=args.served_model_name or args.model, on_step=on_step
            )
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except KVMemoryError as exc:
        raise CliError(kv_message(exc)) from None
    except (ValueError, NativeKernelError) as exc:
        raise CliError(str(exc)) from None
    apply_chat_template_flag(llm.core.tokenizer, args.chat_template)
    if args.allow_special_tokens_in_content:
        llm.prompt_policy = dataclasses.replace(llm.prompt_policy, special_tokens_in_content=True)
    return llm
