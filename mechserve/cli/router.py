"""``mechserve router``: m15's routing policies in front of ``mechserve serve`` workers over HTTP.

The flags are vllm-router's and SGLang router's: ``--worker-urls URL ...``, ``--policy`` (default
``cache_aware``, theirs), ``--cache-threshold`` 0.3, ``--balance-abs-threshold`` 64,
``--balance-rel-threshold`` 1.5, ``--max-tree-size``, ``--host``, ``--port`` (default 30000),
``--health-check-interval-secs``, ``--health-check-timeout-secs``, ``--request-timeout-secs``.
Ours: ``--block-size`` (the workers' ``--page-size``: the router hashes prompts into blocks as they
do), ``--kv-events-endpoints`` (one per worker, for ``precise``), ``--decision-log`` (JSON lines that
``mechserve.router.fleet.replay_log`` takes again through m15) and ``--worker-api-key``.

Importing this module is cheap; ``run`` imports FastAPI and uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any
from urllib.parse import urlsplit

from mechserve.api.config import DEFAULT_PAGE_SIZE
from mechserve.api.limits import ENGINE_LIMITS
from mechserve.cli.errors import CliError
from mechserve.cli.parser import Bounded, api_key

HELP = "route requests across mechserve serve workers by m15's policies (cache_aware, precise, ...)"
POLICIES = ("cache_aware", "precise", "round_robin", "least_loaded")  # mechserve.router.fleet.POLICIES
DEFAULT_PORT = 30000  # sgl-router's and vllm-router's


def worker_url(text: str) -> str:
    """An argparse ``type=``: ``http(s)://host[:port]`` without a path; the trailing slash dropped."""
    url = text.rstrip("/")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker URL such as http://127.0.0.1:8000")
    return url


def zmq_endpoint(text: str) -> str:
    """An argparse ``type=``: a ZeroMQ endpoint ``tcp://host:port`` (or ``ipc://path``)."""
    parts = urlsplit(text)
    ok = (parts.scheme == "tcp" and parts.hostname and parts.port) or (parts.scheme == "ipc" and len(text) > 6)
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ endpoint such as tcp://127.0.0.1:5557")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags (vllm-router's names and defaults where they have one)."""
    add = parser.add_argument
    add("--worker-urls", nargs="+", type=worker_url, default=None, metavar="URL", help="the workers' base URLs")
    add("--policy", choices=POLICIES, default="cache_aware", help="m15's routing policy (default cache_aware)")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    add(
        "--port", type=Bounded(int, ge=0, le=65535), default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )
    add(
        "--cache-threshold",
        type=Bounded(float, ge=0, le=1),
        default=0.3,
        help="cache_aware: share of the prompt to match (0.3)",
    )
    add(
        "--balance-abs-threshold",
        type=Bounded(int, ge=0, le=1 << 31),
        default=64,
        help="cache_aware, and precise's load guard: load gap (64)",
    )
    add(
        "--balance-rel-threshold",
        type=Bounded(float, gt=0),
        default=1.5,
        help="cache_aware, and precise's load guard: load ratio (1.5)",
    )
    add(
        "--max-tree-size",
        type=Bounded(int, ge=0, le=1 << 40),
        default=1 << 26,
        help="cache_aware: tokens per worker's tree",
    )
    add(
        "--block-size",
        type=Bounded(int, ge=1, le=ENGINE_LIMITS["page_size"]),
        default=DEFAULT_PAGE_SIZE,
        help=f"the workers' --page-size: prompts are hashed in blocks of this many tokens (default {DEFAULT_PAGE_SIZE})",
    )
    add(
        "--kv-events-endpoints",
        nargs="+",
        type=zmq_endpoint,
        default=None,
        metavar="ENDPOINT",
        help="precise: each worker's --kv-events-endpoint, in --worker-urls order",
    )
    add(
        "--no-load-guard",
        action="store_true",
        help="precise: score every worker, even one the balance thresholds call overloaded (m15 N24)",
    )
    add("--kv-events-topic", default="", metavar="TOPIC", help="precise: the workers' --kv-events-topic ('')")
    add("--decision-log", default=None, metavar="FILE", help="write every routing input and decision (JSON lines)")
    add(
        "--health-check-interval-secs",
        type=Bounded(float, gt=0, unit="seconds"),
        default=0.5,
        help="seconds between health rounds (0.5)",
    )
    add(
        "--health-check-timeout-secs",
        type=Bounded(float, gt=0, unit="seconds"),
        default=1.0,
        help="a health check's timeout (1)",
    )
    add(
        "--request-timeout-secs",
        type=Bounded(float, gt=0, unit="seconds"),
        default=1800.0,
        help="a routed request's timeout (1800)",
    )
    add(
        "--worker-api-key",
        type=api_key(),
        default=None,
        metavar="KEY",
        help="the key the router's own calls to workers carry",
    )
    add(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )


def check(args: argparse.Namespace) -> None:
    """The checks argparse cannot do alone; ``CliError`` names the flag."""
    if not args.worker_urls:
        raise CliError("--worker-urls: give at least one worker URL")
    if len(set(args.worker_urls)) != len(args.worker_urls):
        raise CliError("--worker-urls: a worker is named twice")
    if args.kv_events_endpoints is not None:
        if args.policy != "precise":
            raise CliError("--kv-events-endpoints: only --policy precise reads KV events")
        if len(args.kv_events_endpoints) != len(args.worker_urls):
            raise CliError("--kv-events-endpoints: give one per --worker-urls entry, in the same order")
    elif args.policy == "precise":
        raise CliError("--policy precise needs --kv-events-endpoints (each worker's --kv-events-endpoint)")
    if args.no_load_guard and args.policy != "precise":
        raise CliError("--no-load-guard: only --policy precise has a load guard")
    if args.kv_events_topic and args.policy != "precise":
        raise CliError("--kv-events-topic: only --policy precise reads KV events")


def run(args: argparse.Namespace) -> int:
    """Serve the router until stopped; returns 0.  ``CliError`` for a bad flag or an address in use."""
    check(args)
    try:
        import uvicorn

        from mechserve.http import background
        from mechserve.router.app import Proxy, build_router_app
        from mechserve.router.fleet import RouterOptions, WorkerFleet
    except ModuleNotFoundError as exc:
        raise CliError(f"router needs {exc.name!r}: pip install 'mechserve[serve]'") from None
    options = RouterOptions(
        args.policy,
        args.block_size,
        args.cache_threshold,
        args.balance_abs_threshold,
        args.balance_rel_threshold,
        args.max_tree_size,
        not args.no_load_guard,
    )
    try:
        log_file = open(args.decision_log, "a", encoding="utf-8") if args.decision_log else None  # noqa: SIM115
    except OSError as exc:
        raise CliError(f"--decision-log: cannot open {args.decision_log}: {exc.strerror or exc}") from None
    try:
        sock = background.bind_socket(args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot bind {args.host}:{args.port}: {exc.strerror or exc}") from None
    fleet = WorkerFleet(args.worker_urls, options, args.kv_events_endpoints or (), log_file)
    proxy = Proxy(
        fleet,
        health_interval=args.health_check_interval_secs,
        health_timeout=args.health_check_timeout_secs,
        request_timeout=args.request_timeout_secs,
        worker_api_key=args.worker_api_key,
        kv_events_topic=args.kv_events_topic,
    )
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_router_app(proxy), lifespan="on", log_level=args.log_level)
    print(
        f"mechserve: routing on http://{host}:{port} by {args.policy} over {len(args.worker_urls)} worker(s); "
        "Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            background.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if log_file is not None:
            log_file.close()
    print("mechserve: router stopped", file=sys.stderr, flush=True)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
