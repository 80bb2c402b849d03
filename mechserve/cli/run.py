"""``mechserve run``: run a workload (a JSON spec or ``--request`` flags) through one rung.

``--backend spec`` (the default) runs it on the rung's scripted executor; on
m15 (``--mech m15``), or on m16 given a ``fleet`` section or fleet flags, it runs a fleet of such engines behind a router (the
workload's ``fleet`` section and the ``--replicas``/``--routing-policy``/...
flags) and prints one fleet record per step.  ``--backend torch`` runs it on a
real model under the top engine rung (m16), through
an ``EngineCore``: the same step trace, then each request's decoded text.
A request's ``prompt_len`` becomes that many real token ids (its synthetic
ids mapped onto the model's ordinary tokens, ``real_prompt``), explicit
``tokens`` are used as ids, and sampling is greedy.  What only the scripted
model has (``accept_script``, ``eos_after``, ``forced_script``) is refused.  ``--world-size N``
runs N tensor-parallel rank processes (``mechserve.executor.rank_group``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from mechserve.api.limits import ENGINE_LIMITS
from mechserve.cli.engine_args import engine_config
from mechserve.cli.errors import CliError, engine_failure
from mechserve.cli.lazy import GENERATE_MODULE
from mechserve.cli.parser import add_device_arguments
from mechserve.cli.render import IDLE, FleetJsonView, FleetTextView, JsonView, TextView, View
from mechserve.cli.viz import VizOutputs, add_output_flags
from mechserve.spec import ENGINE_TOP
from mechserve.workload import (
    ENGINE_DEFAULTS,
    ENGINE_KEYS,
    ENGINE_SWITCHES,
    FLEET_KEYS,
    REQUEST_FLAG,
    ROUTING_POLICIES,
    RequestSpec,
    Workload,
    WorkloadError,
    build_engine,
    build_fleet,
    engine_params,
    has_routing,
    load_rung,
    load_workload,
    rung_label,
    rung_range,
    runs_fleet,
    with_engine,
    with_fleet,
    workload_from_flags,
)

# engine value -> its flag
ENGINE_FLAGS = {name: "--" + name.replace("_", "-") for name in (*ENGINE_KEYS, *ENGINE_SWITCHES)}
# m15: fleet value -> its flag (vllm-router's and sgl-router's names for the thresholds)
FLEET_FLAGS = {name: "--" + name.replace("_", "-") for name in FLEET_KEYS}
# Why a step with nothing in it did nothing, when some request is running (m02/m03's never-fits step).
STUCK = "nothing could be scheduled for the running requests"
BACKENDS = ("spec", "torch")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mech``, ``--json``, ``--explain``, ``--viz`` and ``--plot``, shared by ``run`` and ``demo``."""
    parser.add_argument(
        "--mech",
        metavar="mNN",
        default=ENGINE_TOP,
        help=f"the rung to run: {rung_range()} or a full name (default: {ENGINE_TOP}, the top rung of one engine; "
        "m15 runs a fleet, and so does m16 given a fleet section)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per step, then the summary")
    parser.add_argument("--explain", action="store_true", help="add the engine's own sentences to every step")
    add_output_flags(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechserve run`` (MECHANISMS 4.1)."""
    parser.add_argument("--spec", metavar="FILE", help="a JSON workload spec ('-' reads stdin)")
    parser.add_argument(
        "--request",
        metavar=REQUEST_FLAG,
        action="append",
        default=[],
        help="one request with a synthetic prompt (repeatable)",
    )
    for name, flag in ENGINE_FLAGS.items():
        if name in ENGINE_SWITCHES:
            continue
        if name in ENGINE_DEFAULTS:
            text = f"override the engine's {name} (default {ENGINE_DEFAULTS[name]}"
        else:
            text = f"set the engine's {name} (m12 or later; default: no limit"
        parser.add_argument(flag, type=int, metavar="N", help=f"{text}; at most {ENGINE_LIMITS[name]})")
    parser.add_argument(
        ENGINE_FLAGS["prefix_caching"],
        action=argparse.BooleanOptionalAction,
        help="reuse and publish prompt pages through the prefix cache (m08 or later; default: the workload's "
        "prefix_caching, else on)",
    )
    parser.add_argument(
        ENGINE_FLAGS["hold_shared_prefix"],
        action=argparse.BooleanOptionalAction,
        help="admit a request only once the prompt prefix it shares with a running request is cached (m12 or "
        "later, needs prefix caching; default: the workload's hold_shared_prefix, else off on the spec backend "
        "and on with --backend torch)",
    )
    parser.add_argument(
        ENGINE_FLAGS["output_caching"],
        action=argparse.BooleanOptionalAction,
        help="publish generated blocks into the prefix cache too (m13 or later; default: the workload's "
        "output_caching, else off on the spec backend and on with --backend torch)",
    )
    fleet = parser.add_argument_group("fleet (m15)")
    fleet.add_argument(FLEET_FLAGS["replicas"], type=int, metavar="N", help="replicas behind the router (default 1)")
    fleet.add_argument(
        FLEET_FLAGS["routing_policy"], choices=ROUTING_POLICIES, help="how the router places requests (default precise)"
    )
    fleet.add_argument(
        FLEET_FLAGS["cache_threshold"], type=float, metavar="F", help="cache_aware's match threshold (default 0.3)"
    )
    fleet.add_argument(
        FLEET_FLAGS["balance_abs_threshold"],
        type=int,
        metavar="N",
        help="cache_aware's load rule and precise's load guard, absolute (default 64)",
    )
    fleet.add_argument(
        FLEET_FLAGS["balance_rel_threshold"],
        type=float,
        metavar="F",
        help="cache_aware's load rule and precise's load guard, relative (default 1.5)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="spec",
        help="spec: the rung's scripted executor (default); torch: a real model under the top rung, "
        "greedy, prompt lengths as real tokens (needs the torch extra)",
    )
    parser.add_argument(
        "--model",
        metavar="M",
        help="with --backend torch: 'smollm2' (the embedded model, default), a local Hugging Face directory or a GGUF file",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="with --backend torch: weights, activations and KV cache (default float32)",
    )
    parser.add_argument(
        "--quantization",
        choices=("q4_1", "q8_0"),
        help="with --backend torch: the weight matrices in GGUF blocks, multiplied as they are",
    )
    add_device_arguments(parser, "with --backend torch: ")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the workload the arguments describe.

    Raises ``CliError`` for both or neither of ``--spec``/``--request``, an
    unreadable spec file or an engine failure, and ``WorkloadError`` for an
    invalid workload or rung.
    """
    rung = load_rung(args.mech)
    viz = VizOutputs.from_args(args)
    overrides = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    workload = with_engine(read_workload(args.spec, args.request), overrides, ENGINE_FLAGS)
    fleet = {name: getattr(args, name) for name in FLEET_FLAGS if getattr(args, name) is not None}
    if fleet and not has_routing(rung):  # m15: one line naming every fleet flag given
        named = ", ".join(f"{FLEET_FLAGS[name]} {value}" for name, value in fleet.items())
        raise CliError(f"{rung_label(rung)} has no routing: {named} need --mech m15 (or drop them)")
    if fleet and args.backend == "torch":  # name the flags given, not the fleet section they become
        named = ", ".join(f"{FLEET_FLAGS[name]} {value}" for name, value in fleet.items())
        raise CliError(f"--backend torch runs one engine; {named} need --backend spec")
    workload = with_fleet(workload, fleet, FLEET_FLAGS)
    if args.backend == "torch":
        return execute_torch(
            rung,
            workload,
            model=args.model or "smollm2",
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device or "cpu",
            compile=bool(args.compile),
            as_json=args.json,
            explain=args.explain,
            viz=viz,
        )
    given = (
        ("--model", args.model),
        ("--dtype", args.dtype),
        ("--quantization", args.quantization),
        ("--device", args.device),
        ("--compile", args.compile),
    )
    for flag, value in given:
        if value is not None:
            raise CliError(f"{flag} needs --backend torch (the spec backend runs the scripted model)")
    return execute(rung, workload, as_json=args.json, explain=args.explain, viz=viz)


def read_workload(spec: str | None, requests: Sequence[str]) -> Workload:
    """The workload from ``--spec FILE`` or from ``--request`` flags (exactly one of them).

    Raises ``CliError`` for both, neither, or an unreadable file, and
    ``WorkloadError`` for an invalid workload.
    """
    if spec is not None and requests:
        raise CliError("give either --spec FILE or --request flags, not both")
    if spec is None and not requests:
        raise CliError(f"nothing to run: give --spec FILE or at least one --request {REQUEST_FLAG}")
    if spec is None:
        return workload_from_flags(requests)
    return load_workload(_read_text(spec), source="stdin" if spec == "-" else spec)


def _read_text(path: str) -> str:
    """The text of ``path`` (``-`` is stdin); raises ``CliError`` if it cannot be read."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CliError(f"cannot read workload {path}: {reason}") from None


def header(rung: ModuleType, workload: Workload) -> str:
    """One line naming the rung, the engine values it takes (m15: and the fleet values given) and the
    number of requests."""
    params = engine_params(rung)
    used = [f"{name} {_shown(value)}" for name, value in workload.engine.items() if name in params]
    used += [f"{name} {value}" for name, value in workload.fleet.items()]
    parts = [f"{rung_label(rung)} {rung.TITLE}", *used, f"{len(workload.requests)} request(s)"]
    return " · ".join(parts)


def _shown(value: int) -> str:
    """An engine value in the header: a switch as on/off, a number as itself."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def execute(
    rung: ModuleType,
    workload: Workload,
    *,
    as_json: bool,
    explain: bool,
    notes: Sequence[str] = (),
    viz: VizOutputs | None = None,
) -> int:
    """Run ``workload`` on ``rung`` and print it; return 0.

    Every step is printed as it completes.  If the engine fails part-way the
    printed steps stay, no summary follows, and ``CliError`` names the
    exception and the step.  Raises ``WorkloadError`` if the rung cannot take
    the workload and ``CliError`` if the engine rejects it.  ``viz`` names
    the pictures to write (``--viz``/``--plot``), also of a failed run's
    steps.
    """
    fleet = runs_fleet(rung, workload)
    viz = viz or VizOutputs()
    if fleet and (viz.viz or viz.plot):
        raise CliError(f"--viz and --plot draw one engine's pool; {rung_label(rung)} runs a fleet (use --mech m14)")
    try:
        engine = build_fleet(rung, workload) if fleet else build_engine(rung, workload)
    except WorkloadError:
        raise
    except ValueError as exc:
        raise CliError(f"the {rung_label(rung)} engine rejected the workload: {exc}") from exc
    view: View
    if fleet:
        view = FleetJsonView(explain) if as_json else FleetTextView(explain)
    else:
        view = JsonView(explain) if as_json else TextView(explain)
    view.start(header(rung, workload), notes)
    recorder = viz.recorder(engine, header(rung, workload))

    def show(record: object) -> None:
        view.step(record, STUCK if engine.running else IDLE)
        if recorder is not None:
            recorder(record)

    try:
        engine.run(on_step=show)
    except BrokenPipeError:
        raise
    except Exception as exc:  # any engine failure is reported, never a traceback (D3)
        view.flush()
        viz.write(recorder, None)
        raise CliError(engine_failure(exc, engine.step_counter)) from exc
    view.finish(engine.summary())
    viz.write(recorder, engine.summary())
    return 0


def check_torch_workload(rung: ModuleType, workload: Workload) -> None:
    """Raise ``CliError`` for what a real model cannot run: a rung other than the top engine rung, a
    fleet, scripted verdicts."""
    if rung.__name__.rsplit(".", 1)[-1] != ENGINE_TOP:
        raise CliError(
            f"--backend torch runs the top engine rung ({ENGINE_TOP[:3]}); drop --mech {rung_label(rung)} or use --backend spec"
        )
    if workload.fleet:
        given = ", ".join(f"fleet.{name}" for name in workload.fleet)
        raise CliError(f"--backend torch runs one engine; {given} need --backend spec --mech m15")
    for req in workload.requests:
        if req.accept_script:
            raise CliError(
                f"request {req.request_id!r} has an accept_script: a real model's verifier decides what it "
                "accepts, so scripted verdicts cannot apply (remove accept_script)"
            )
        if req.eos_after is not None:
            raise CliError(
                f"request {req.request_id!r} has eos_after: a real model ends on its own EOS token, so the scripted "
                "trigger cannot apply (remove eos_after; max_new_tokens still bounds the output)"
            )
        if req.forced_script:
            raise CliError(
                f"request {req.request_id!r} has a forced_script: a real model's forced ids come from its "
                "grammar (structured outputs), so a scripted grammar cannot apply (remove forced_script)"
            )
        if req.draft_limit_script:
            raise CliError(
                f"request {req.request_id!r} has a draft_limit_script: a real run's draft limits come from its "
                "speculation governor, so scripted limits cannot apply (remove draft_limit_script)"
            )


def real_prompt(req: RequestSpec, vocab_size: int, ordinary: Sequence[int]) -> list[int]:
    """The token ids ``req`` runs with on a real model.

    Explicit ``tokens`` are the ids themselves; a ``prompt_len`` prompt's
    synthetic ids ``s`` become ``ordinary[s % len(ordinary)]`` (the model's
    non-special tokens), so prompts that share synthetic ids share real ids
    and no others do, as in the spec.  Raises ``CliError`` for an explicit
    id or a stop token id outside the vocabulary.
    """
    for name, ids in (("tokens", () if req.synthetic else req.tokens), ("stop_token_ids", req.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise CliError(
                f"request {req.request_id!r}: {name} holds {bad}, not a token id of the model "
                f"(vocabulary of {vocab_size}: 0..{vocab_size - 1})"
            )
    if not req.synthetic:
        return list(req.tokens)
    return [ordinary[s % len(ordinary)] for s in req.tokens]


def ordinary_ids(vocab_size: int, tokenizer: object, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids that are neither special tokens of ``tokenizer`` nor EOS ids, ascending."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(eos_token_ids)
    return [t for t in range(vocab_size) if t not in special] or list(range(vocab_size))


def execute_torch(
    rung: ModuleType,
    workload: Workload,
    *,
    model: str,
    dtype: str | None = None,
    quantization: str | None = None,
    device: str = "cpu",
    compile: bool = False,
    as_json: bool,
    explain: bool,
    viz: VizOutputs | None = None,
) -> int:
    """Run ``workload`` on ``model`` under the top rung and print the trace, the summary and each text; return 0.

    Requests the door refuses show in the trace's ``rejected`` field, as on
    the spec backend.  Raises ``CliError`` for a rung below the top, a
    workload a real model cannot run (``check_torch_workload``, ids outside
    the vocabulary), a model that cannot be loaded, a KV cache that does not
    fit, or an engine failure part-way (after the steps before it).
    """
    check_torch_workload(rung, workload)
    try:
        from mechserve.api.errors import KVMemoryError, ModelLoadError, RankError, RequestRejected, first_line
        from mechserve.api.params import SamplingParams
        from mechserve.engine.core import EngineCore
        from mechserve.engine.executors import configure_threads
    except ModuleNotFoundError as exc:
        raise CliError(f"--backend torch needs {exc.name!r}: pip install 'mechserve[torch]'") from None
    generate = importlib.import_module(GENERATE_MODULE)  # its error wording and model loading are shared
    e = workload.engine
    try:
        flags = argparse.Namespace(dtype=dtype, quantization=quantization, device=device, compile=compile)
        names = (
            "max_step_tokens",
            "page_size",
            "num_pages",
            "spec_len",
            "world_size",
            "prefix_caching",
            "hold_shared_prefix",
            "output_caching",
        )
        sizes: dict[str, Any] = {name: e[name] for name in names if name in e}
        if (
            sizes.get("prefix_caching") is False
        ):  # the hold acts only through the prefix cache (D9's loader refuses true)
            sizes.setdefault("hold_shared_prefix", False)
        config = engine_config(
            flags,
            **sizes,
            max_model_len=e.get("max_model_len"),
            max_running=e.get("max_running"),  # a workload without max_running runs every request at once
            max_waiting=e.get("max_waiting"),
        )
        configure_threads()
        loaded = generate.load(model, dtype, e["world_size"], quantization)
        vocab = loaded.model.arch.vocab_size
        ordinary = ordinary_ids(vocab, loaded.tokenizer, loaded.eos_token_ids)
        prompts = [real_prompt(req, vocab, ordinary) for req in workload.requests]
        core = EngineCore(loaded, config, keep_finished=True)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except KVMemoryError as exc:
        raise CliError(generate.kv_message(exc)) from None
    except (ValueError, RankError) as exc:  # a world size the model cannot split into, a rank that cannot start
        raise CliError(first_line(exc)) from None
    view: View = JsonView(explain) if as_json else TextView(explain)
    view.start(f"{header(rung, workload)} · torch backend, model {model}", ())
    viz = viz or VizOutputs()
    tokenizer = loaded.tokenizer
    decode = None if tokenizer is None else lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))
    recorder = viz.recorder(core.scheduler.spec_engine, f"{header(rung, workload)} · model {model}", decode)
    for req, ids in zip(workload.requests, prompts):
        params = SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, stop_token_ids=req.stop_token_ids)
        with contextlib.suppress(RequestRejected):  # the next step's `rejected` field shows it
            core.add_request(ids, params, request_id=req.request_id, arrival_step=req.arrival_step)

    def seen(out: Any) -> None:
        view.step(out.record, STUCK if core.stats().running else IDLE)
        if recorder is not None:
            recorder(out.record)

    try:
        outputs = {o.request_id: o for o in core.run_until_idle(seen)}
    except BrokenPipeError:
        raise
    except Exception as exc:  # any engine failure is reported, never a traceback (D3)
        view.flush()
        viz.write(recorder, None)
        raise CliError(generate.step_failure(exc, core.step_counter)) from exc
    finally:
        core.close()
    texts = [
        {
            "request_id": req.request_id,
            "text": outputs[req.request_id].outputs[0].text,
            "token_ids": outputs[req.request_id].outputs[0].token_ids,
            "finish_reason": outputs[req.request_id].outputs[0].finish_reason,
            "stop_reason": outputs[req.request_id].outputs[0].stop_reason,
        }
        for req in workload.requests
        if req.request_id in outputs
    ]
    view.finish(core.summary(), texts)
    viz.write(recorder, core.summary(), texts)
    return 0
