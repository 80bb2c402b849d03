"""The engines the harness compares, behind one runner interface.

``Runner.run(workload, variant)`` submits every request of a ``Workload`` (all at once, or one at a
time when ``workload.sequential``), waits for exactly the wanted tokens and returns a ``RunResult``:
per-request timestamps (``RequestTiming``), the generated ids, the run's wall time and peak RSS, and
engine-side figures where the engine has them.

* ``mechserve``: ``EngineCore`` (continuous batching under the m13 spec scheduler, paged KV, chunked
  prefill).  Variants: ``default``; on the prefix workload ``prefix-cache`` (with m12's
  shared-prefix hold, the product default) / ``no-prefix-cache``;
  on the spec workload ``no-spec`` / ``ngram-K`` (prompt lookup with K guesses).  Its figures
  come from the trace (``metrics.trace_stats``) plus step, executor and forward times.
* ``hf``: transformers ``generate``, static batching with left padding, greedy, EOS suppressed until
  the batch's longest request is done; a request's tokens are its first ``max_tokens`` of its batch
  (the rest is waste, as in static batching).  Its per-token times come from a streamer.
* ``llama-cpp``: ``llama-server`` (``mechserve.bench.llama_cpp``) on the mode's GGUF (F32 for exact,
  BF16 for fast, the shipped Q4_1 or a Q8_0 for the quantized modes; ``--model FILE.gguf``: that file in
  every mode), 32 parallel slots, the same
  token-id prompts with ``n_predict``/``ignore_eos``/greedy/no prompt cache; per-token times are taken
  at the client from the streamed events.  Optional: ``available()`` says why it is skipped.
* ``vllm``: optional; ``available()`` says why it is skipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from mechserve.bench import llama_cpp
from mechserve.bench.llama_cpp import SLOTS
from mechserve.bench.timings import RequestTiming, trace_stats
from mechserve.bench.workloads import Workload

ENGINES = ("mechserve", "hf", "llama-cpp", "vllm")
# mode -> (activation dtype, weight quantization): exact and fast are float32 and bfloat16 throughout;
# q4_1 and q8_0 keep the weight matrices in GGUF blocks with bfloat16 activations and KV.
MODES: dict[str, tuple[torch.dtype, str | None]] = {
    "exact": (torch.float32, None),
    "fast": (torch.bfloat16, None),
    "q4_1": (torch.bfloat16, "q4_1"),
    "q8_0": (torch.bfloat16, "q8_0"),
}


@dataclass(slots=True)
class RunResult:
    """One engine's run of one workload (times in seconds, memory in bytes).  ``peak_rss_bytes``: the peak
    resident set during the run (after the warm-up) of the process that ran it; ``process_peak_rss_bytes``:
    that process's peak over its life, loading included, when it ran alone (``fresh.run_fresh``)."""

    engine: str
    variant: str
    mode: str
    timings: list[RequestTiming]
    duration: float
    outputs: list[list[int]]
    peak_rss_bytes: int | None
    engine_stats: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    process_peak_rss_bytes: int | None = None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5); False where that is not possible."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def parse_proc_stat(text: str, hz: int) -> tuple[float, float]:
    """``(busy, steal)``: CPU seconds of every CPU together since boot from the text of ``/proc/stat`` (its first
    line, in clock ticks of ``1 / hz`` s: user, nice, system, irq and softirq are busy; idle and iowait are
    not; steal is the time a virtual machine's CPUs were ready but the host ran something else).  Raises
    ``ValueError`` for text without a ``cpu`` line of at least 8 counters."""
    first = text.splitlines()[0].split() if text else []
    if len(first) < 9 or first[0] != "cpu":
        raise ValueError(f"not /proc/stat's cpu line: {first[:1]}")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    return (user + nice + system + irq + softirq) / hz, steal / hz


def machine_cpu() -> tuple[float, float] | None:
    """``parse_proc_stat`` of this machine now; None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        return parse_proc_stat(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None


def other_load(
    before: tuple[float, float] | None, after: tuple[float, float] | None, own_cpu_s: float, wall_s: float
) -> dict[str, float | None]:
    """What else the machine ran during ``wall_s`` seconds in which this process used ``own_cpu_s`` CPU seconds,
    from two ``machine_cpu`` readings: ``other_cores`` (the CPU seconds of every other process per second, in
    cores; 0.5 is half a core busy all along) and ``steal_cores`` (the same for the host's steal).  Both None
    where either reading is missing.  A 2-core machine's two OpenMP threads wait at every barrier for the one
    that another process holds off its core, so a run's steps there are only comparable beside these figures
    (docs/benchmarks.md, issue 28's batch-1 steps)."""
    if before is None or after is None or wall_s <= 0:
        return {"other_cores": None, "steal_cores": None}
    busy, steal = after[0] - before[0], after[1] - before[1]
    return {"other_cores": max(busy - own_cpu_s, 0.0) / wall_s, "steal_cores": max(steal, 0.0) / wall_s}


def peak_rss() -> int | None:
    """This process's peak resident set size in bytes since the last reset (``VmHWM``); None if unknown."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Runner:
    """The interface: ``name``, ``available()`` (None, or why it is skipped), ``variants(workload)``,
    ``run(workload, variant)``."""

    name = "?"

    def available(self) -> str | None:
        return None

    def variants(self, workload: Workload) -> list[str]:
        return ["default"]

    def run(self, workload: Workload, variant: str) -> RunResult:  # pragma: no cover - interface
        raise NotImplementedError


@contextmanager
def _timed(obj: Any, attr: str, sink: list[float]) -> Iterator[None]:
    """Wrap ``obj.attr`` (a bound method) so that each call's seconds are appended to ``sink``."""
    inner: Callable[..., Any] = getattr(obj, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        delattr(obj, attr)  # the class's method shows through again


class MechserveRunner(Runner):
    """``EngineCore`` over the loaded model, one fresh engine (and KV cache) per run."""

    name = "mechserve"

    def __init__(self, loaded: Any, mode: str, config: Any, *, spec_len: int | None = None) -> None:
        """``config``: the ``EngineConfig`` the bench's flags give (``mechserve.cli.engine_args.engine_config``);
        each run replaces its sizes (dtype, pool, spec_len, prefix caching).  ``spec_len``: also run the
        throughput and latency workloads with prompt-lookup speculation (variant ``ngram-<spec_len>``)."""
        self.loaded = loaded
        self.mode = mode
        self.spec_len = spec_len
        self.config = config
        self.max_step_tokens = config.max_step_tokens
        self.page_size = config.page_size

    def variants(self, workload: Workload) -> list[str]:
        if workload.name == "prefix":
            return ["prefix-cache", "no-prefix-cache"]
        if workload.name == "spec":
            return ["no-spec", "ngram-4"]
        return ["default"] + ([f"ngram-{self.spec_len}"] if self.spec_len else [])

    def _core(self, workload: Workload, variant: str) -> Any:
        from mechserve.api.config import dtype_name
        from mechserve.engine.core import EngineCore

        spec_len = int(variant.split("-")[1]) if variant.startswith("ngram-") else 0
        longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
        batch = 1 if workload.sequential else len(workload.requests)
        pages = batch * -(-longest // self.page_size) + 8
        config = self.config.replace(
            dtype=dtype_name(self.loaded.model.dtype),
            quantization=getattr(self.loaded.model, "quantization", None),
            num_pages=pages,
            spec_len=spec_len,
            prefix_caching=variant != "no-prefix-cache",
            max_running=None,  # every request of the workload may run at once, as in the static batches it is compared with
        )
        return EngineCore(self.loaded, config)

    def run(self, workload: Workload, variant: str) -> RunResult:
        from mechserve.api.params import SamplingParams

        core = self._core(workload, variant)
        _warm_up(core, SamplingParams)
        step_s: list[float] = []
        exec_s: list[float] = []
        fwd_s: list[float] = []
        records: list[Any] = []
        finished: dict[str, Any] = {}

        last = [0.0]
        forwards_at: list[int] = []  # how many forwards had run at the end of each step

        def seen(out: Any) -> None:
            now = time.perf_counter()
            step_s.append(now - last[0])
            forwards_at.append(len(fwd_s))
            records.append(out.record)
            finished.update((o.request_id, o) for o in out.finished)
            last[0] = time.perf_counter()

        def drain() -> None:
            last[0] = time.perf_counter()
            core.run_until_idle(seen)

        ids: list[str] = []
        reset_peak_rss()
        machine_before, cpu_before = machine_cpu(), time.process_time()
        with _timed(core.executor, "execute", exec_s), _timed(core.model, "forward", fwd_s):
            start = time.perf_counter()
            for r in workload.requests:
                params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
                ids.append(core.add_request(list(r.prompt_ids), params))
                if workload.sequential:
                    drain()
            drain()
            duration = time.perf_counter() - start
        load = other_load(machine_before, machine_cpu(), time.process_time() - cpu_before, duration)
        rss = peak_rss()
        timings, outputs = [], []
        for rid, r in zip(ids, workload.requests):
            o = finished[rid]
            timings.append(RequestTiming(len(r.prompt_ids), o.metrics.arrival_time, o.metrics.token_times[0]))
            outputs.append(list(o.outputs[0].token_ids))
        stats = trace_stats(records, workload.prompt_tokens)
        step_total, exec_total, fwd_total = sum(step_s), sum(exec_s), sum(fwd_s)
        stats.update(
            step_time_s=step_total,
            executor_time_s=exec_total,
            forward_time_s=fwd_total,
            scheduler_time_s=step_total - exec_total,
            scheduler_fraction=(step_total - exec_total) / step_total if step_total else None,
            step_time_series_s=step_s,
            # each step's seconds inside the model's forward (a step may run none, or a prompt-logprob recompute)
            forward_time_series_s=[sum(fwd_s[a:b]) for a, b in zip([0, *forwards_at], forwards_at)],
            **load,
        )
        c = core.config
        settings = {
            "max_step_tokens": self.max_step_tokens,
            "page_size": self.page_size,
            "num_pages": core.num_pages,
            "prefix_caching": c.prefix_caching,
            "hold_shared_prefix": c.prefix_caching and c.hold_shared_prefix,
            "device": c.device,
            "compile": c.compile,
        }
        return RunResult(self.name, variant, self.mode, timings, duration, outputs, rss, stats, settings)


def _warm_up(core: Any, sampling_params: Any) -> None:
    """One short request through a fresh engine, so first-call costs stay out of the timed run."""
    core.add_request([1, 2, 3, 4, 5, 6, 7, 8], sampling_params(temperature=0, max_tokens=2, ignore_eos=True))
    core.run_until_idle()


class HFRunner(Runner):
    """transformers ``generate`` with static batches of ``batch_size`` (left padding, greedy)."""

    name = "hf"

    def __init__(self, path: Path, mode: str, *, batch_size: int | None = None, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        dtype, quantization = MODES[mode]
        if quantization is not None:
            raise ValueError(f"hf has no {mode} mode")
        self.device = torch.device(device)
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval().to(self.device)
        )
        self.mode = mode
        self.batch_size = batch_size
        self.pad_id = 0

    def run(self, workload: Workload, variant: str) -> RunResult:
        reqs = workload.requests
        size = 1 if workload.sequential else min(self.batch_size or len(reqs), len(reqs))
        self._generate([(1, 2, 3, 4)], 2)  # warm-up
        timings: list[RequestTiming] = []
        outputs: list[list[int]] = []
        reset_peak_rss()
        start = time.perf_counter()
        for b in range(0, len(reqs), size):
            batch = reqs[b : b + size]
            arrival = time.perf_counter() if workload.sequential else start
            ids, times = self._generate([r.prompt_ids for r in batch], max(r.max_tokens for r in batch))
            for i, r in enumerate(batch):
                timings.append(RequestTiming(len(r.prompt_ids), arrival, tuple(times[: r.max_tokens])))
                outputs.append(ids[i][: r.max_tokens])
        duration = time.perf_counter() - start
        return RunResult(
            self.name,
            variant,
            self.mode,
            timings,
            duration,
            outputs,
            peak_rss(),
            None,
            {"batch_size": size, "device": str(self.device)},
        )

    def _generate(self, prompts: Sequence[Sequence[int]], new: int) -> tuple[list[list[int]], list[float]]:
        """Left-padded greedy generation of exactly ``new`` tokens per row; the ids and each token step's time."""
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (longest - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        streamer = _TimeStreamer()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=streamer,
            )
        return out[:, longest:].tolist(), streamer.times


class _TimeStreamer:
    """A transformers streamer that keeps the time of each generated-token step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            torch.cuda.synchronize(value.device)  # the token exists once its kernels have run
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class LlamaCppRunner(Runner):
    """``llama-server`` on the mode's GGUF, restarted per workload with a context that fits it."""

    name = "llama-cpp"

    def __init__(self, mode: str, *, model: str = "smollm2", threads: int | None = None, slots: int = SLOTS) -> None:
        self.mode = mode
        self.model = model
        self.threads = threads or torch.get_num_threads()
        self.slots = slots

    def available(self) -> str | None:
        refusal = llama_cpp.unsupported_model(self.model)
        return f"llama-cpp skipped: {refusal}" if refusal is not None else llama_cpp.missing_message()

    def run(self, workload: Workload, variant: str) -> RunResult:
        gguf = llama_cpp.gguf_for(self.model, self.mode)
        longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
        context = -(-(longest + 8) // 256) * 256  # per slot, rounded up
        server = llama_cpp.LlamaServer(gguf, threads=self.threads, slots=self.slots, context=context)
        try:
            requests = [(r.prompt_ids, r.max_tokens) for r in workload.requests]
            llama_cpp.reset_proc_peak_rss(server.process.pid)
            arrivals, done, duration = llama_cpp.run_requests(server, requests, sequential=workload.sequential)
            rss = llama_cpp.proc_peak_rss(server.process.pid)
            version = server.version()
        finally:
            server.close()
        timings = [
            RequestTiming(len(r.prompt_ids), a, tuple(c.token_times[: r.max_tokens]))
            for r, a, c in zip(workload.requests, arrivals, done)
        ]
        outputs = [c.tokens[: r.max_tokens] for r, c in zip(workload.requests, done)]
        stats = {
            "server_prompt_ms": [c.timings.get("prompt_ms") for c in done],
            "server_predicted_ms": [c.timings.get("predicted_ms") for c in done],
        }
        settings = {
            "gguf": gguf.name,
            "slots": self.slots,
            "context_per_slot": context,
            "threads": self.threads,
            "server": server.command[0],
            "version": version,
        }
        return RunResult(self.name, variant, self.mode, timings, duration, outputs, rss, stats, settings)


class OptionalRunner(Runner):
    """An engine used only where its package is installed (``vllm``)."""

    PACKAGES: ClassVar[dict[str, tuple[str, str]]] = {"vllm": ("vllm", "vllm")}

    def __init__(self, name: str) -> None:
        self.name = name

    def available(self) -> str | None:
        import importlib.util

        module, package = self.PACKAGES[self.name]
        if importlib.util.find_spec(module) is None:
            return f"{self.name} skipped: the {package!r} package is not installed (pip install {package})"
        return f"{self.name} skipped: {package} is installed, but its runner is not done in this harness yet"


# Multi-turn conversations ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One turn of one conversation on one engine configuration.

    ``prompt_len``: its prompt tokens (the chat template over every message so far); ``new_tokens``:
    those the previous turn never computed (None at turn 1): the rest of its answer's last block
    aside, what output caching leaves to compute; ``prefill_computed``: prompt positions the engine
    ran before the first token (recomputation after a preemption included); ``reused``: prompt
    tokens served from the prefix cache; ``ttft``: seconds on the engine's own clock from submission
    to the first token, and ``ttft_cpu`` the CPU seconds this process spent in those steps (on a
    machine shared with other work, the less noisy of the two); ``retokenized``: whether the prompt repeats the previous prompt and answer ids
    exactly (None at turn 1); ``output_ids``: the answer.
    """

    conversation: int
    turn: int
    prompt_len: int
    new_tokens: int | None
    prefill_computed: int
    reused: int
    ttft: float
    ttft_cpu: float
    retokenized: bool | None
    output_ids: tuple[int, ...]


class _Conversing:
    """One engine configuration running every conversation: turn 1 of each at once, then each next turn as
    soon as the previous answer is done.  ``clock`` adds up the seconds spent inside this engine's steps,
    ``cpu`` the CPU seconds of this process in them."""

    def __init__(self, core: Any, conversations: Any) -> None:
        self.core = core
        self.conversations = conversations
        self.clock = 0.0
        self.cpu = 0.0
        self.results: list[TurnResult] = []
        self._history: list[list[dict[str, str]]] = [[] for _ in conversations.messages]
        self._live: dict[str, dict[str, Any]] = {}  # request id -> its turn's bookkeeping
        self._previous: dict[int, list[int]] = {}  # conversation -> its last prompt + answer ids

    @property
    def done(self) -> bool:
        return not self._live and not self.core.has_unfinished()

    def start(self) -> None:
        for c in range(len(self.conversations.messages)):
            self._submit(c, 0)

    def _submit(self, c: int, turn: int) -> None:
        from mechserve.api.params import SamplingParams
        from mechserve.entrypoints.prompts import Chat, encode_chat

        self._history[c].append({"role": "user", "content": self.conversations.messages[c][turn]})
        _, ids = encode_chat(self.core.tokenizer, Chat(list(self._history[c])))
        params = SamplingParams(temperature=0.0, max_tokens=self.conversations.max_tokens)
        rid = self.core.add_request(ids, params)
        self._live[rid] = {
            "c": c,
            "turn": turn,
            "ids": ids,
            "at": (self.clock, self.cpu),
            "first": None,
            "prefill": 0,
            "reused": None,
        }

    def step(self) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        out = self.core.step()
        self.clock += time.perf_counter() - started
        self.cpu += time.process_time() - cpu
        rec = out.record
        for rid, turn in self._live.items():
            if turn["first"] is None:
                turn["prefill"] += rec.executed.get(rid, 0)
                if turn["reused"] is None and rid in rec.reused:
                    turn["reused"] = rec.reused[rid]
                if rid in rec.tokens:
                    turn["first"] = (self.clock, self.cpu)
        for done in out.finished:
            self._finish(done)

    def _finish(self, done: Any) -> None:
        turn = self._live.pop(done.request_id)
        c, t, ids = turn["c"], turn["turn"], turn["ids"]
        answer = list(done.outputs[0].token_ids)
        previous = self._previous.get(c)
        computed = len(previous) - 1 if previous is not None else 0  # the last id is never computed
        self.results.append(
            TurnResult(
                conversation=c,
                turn=t + 1,
                prompt_len=len(ids),
                new_tokens=len(ids) - computed if previous is not None else None,
                prefill_computed=turn["prefill"],
                reused=turn["reused"] or 0,
                ttft=turn["first"][0] - turn["at"][0],
                ttft_cpu=turn["first"][1] - turn["at"][1],
                retokenized=ids[:computed] == previous[:computed] if previous is not None else None,
                output_ids=tuple(answer),
            )
        )
        self._previous[c] = [*ids, *answer]
        self._history[c].append({"role": "assistant", "content": done.outputs[0].text})
        if t + 1 < len(self.conversations.messages[c]):
            self._submit(c, t + 1)


def run_conversations(loaded: Any, conversations: Any, configs: dict[str, Any]) -> dict[str, list[TurnResult]]:
    """Every conversation on one fresh ``EngineCore`` per configuration (``configs``: name -> ``EngineConfig``),
    the engines stepped in turn, one step each, so that a busy machine's noise falls on all of them alike;
    each turn's TTFT is measured on its own engine's clock (the time spent in that engine's steps), which is
    what it would be with the engine alone.  ``loaded`` needs a tokenizer with a chat template."""
    from mechserve.api.params import SamplingParams
    from mechserve.engine.core import EngineCore

    engines = {name: _Conversing(EngineCore(loaded, config), conversations) for name, config in configs.items()}
    for e in engines.values():
        _warm_up(e.core, SamplingParams)
        e.start()
    while not all(e.done for e in engines.values()):
        for e in engines.values():
            if not e.done:
                e.step()
    return {name: sorted(e.results, key=lambda r: (r.conversation, r.turn)) for name, e in engines.items()}


__all__ = [
    "ENGINES",
    "MODES",
    "HFRunner",
    "LlamaCppRunner",
    "MechserveRunner",
    "OptionalRunner",
    "RunResult",
    "Runner",
    "TurnResult",
    "run_conversations",
]
