"""llama.cpp beside ``mechserve bench spec-decode --llama-cpp``: the same prompts and the same work on llama-server.

Every call the bench makes without speculation (configuration ``off``: one turn of up to ``batch`` sessions)
is sent to llama-server too, right after the bench's own configurations ran that group of sessions, so that
a noisy machine slows every engine alike::

    prompt       the token ids our chat template gave for the turn (the conversation so far, with ``off``'s
                 earlier answers): both engines see the same ids
    n_predict    the number of ids ``off`` generated for it, with ``ignore_eos``: the same amount of work
                 whether or not llama.cpp's greedy text ends where ours did (a request ``off`` answered
                 with no id is not sent)
    sampling     greedy (temperature 0)
    cache_prompt on, llama-server's default: a slot reuses the KV of the longest prefix it holds, so a
                 session's next turn computes only its new ids, as our prefix cache lets ``off`` do

One server per GGUF (``--llama-cpp-modes``: by default the embedded model's BF16, Q8_0 and Q4_1 files,
``llama_cpp.gguf_for``; a GGUF ``--model`` is run as it is), started and stopped by ``llama_cpp.LlamaServer``
(the bench's one starter of llama-server), with ``batch`` slots (``-np``) and the bench's
CPU threads, kept for every cell of that batch size; a turn longer than a slot's context restarts the server
with a longer one.  Per cell and GGUF: ``tok_s`` (its output ids over the calls' wall time, first request
sent to last id received), ``wall_s``, ``output_tokens``, ``requests`` and ``identical`` (the requests whose
ids equal ``off``'s, end ids aside: a sanity check, not a requirement: BF16 and the quantized files round
differently).  ``best`` puts the fastest GGUF beside the bench's fastest proposer (``ratio``: our tok/s over
llama.cpp's) and ``off`` (``off_ratio``).

llama.cpp asked for (``--llama-cpp``) but not built is one error before anything runs (``OSError`` from
``check``, naming how to build it); without the flag the bench needs no llama.cpp at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechserve.bench import llama_cpp
from mechserve.model.gguf_file import is_gguf

# the bench's modes llama.cpp runs by default: its best batch-1 candidates (F32, mode exact, is slower than BF16)
DEFAULT_MODES = ("fast", "q8_0", "q4_1")
CONTEXT = 2048  # positions per slot to start with; grown when a turn needs more
CONTEXT_STEP = 1024


@dataclass
class PeerTally:
    """What one GGUF did on one (workload, batch) cell."""

    wall_s: float = 0.0
    output_tokens: int = 0
    requests: int = 0
    identical: int = 0

    def report(self) -> dict[str, Any]:
        return {
            "tok_s": round(self.output_tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
            "requests": self.requests,
            "identical": self.identical,
        }


class LlamaCppBeside:
    """llama-server for each of ``modes`` (or the GGUF ``model`` itself), answering the bench's calls.

    ``kinds``: the name each GGUF is reported under (``bf16``, ``q8_0``, ``q4_1``, ...; a GGUF ``model``: its
    file name).  Raises what ``check`` and ``llama_cpp.gguf_for`` raise, before any server starts.
    """

    def __init__(self, model: str, modes: Sequence[str], threads: int) -> None:
        self.check()
        if is_gguf(model):
            self.ggufs = {Path(model).name: Path(model)}
        else:
            self.ggufs = {llama_cpp.MODE_GGUF[m]: llama_cpp.gguf_for(model, m) for m in modes}
        self.threads = threads
        self._servers: dict[tuple[str, int], llama_cpp.LlamaServer] = {}

    @property
    def kinds(self) -> list[str]:
        return list(self.ggufs)

    @staticmethod
    def check() -> None:
        """Raise ``OSError`` (how to build it) unless llama-server is found."""
        missing = llama_cpp.missing_message()
        if missing is not None:
            raise OSError(missing.replace("llama-cpp skipped: ", "--llama-cpp: ", 1))

    def server(self, kind: str, batch: int, need: int) -> llama_cpp.LlamaServer:
        """The server of GGUF ``kind`` with ``batch`` slots of at least ``need`` positions each (started, warmed
        up, by ``llama_cpp.LlamaServer``; one with slots too short for ``need`` is stopped and replaced)."""
        found = self._servers.get((kind, batch))
        if found is not None and found.context >= need:
            return found
        if found is not None:
            del self._servers[(kind, batch)]
            found.close()
        context = max(CONTEXT, -(-need // CONTEXT_STEP) * CONTEXT_STEP)
        started = llama_cpp.LlamaServer(self.ggufs[kind], threads=self.threads, slots=batch, context=context)
        self._servers[(kind, batch)] = started
        return started

    def run(
        self,
        batch: int,
        calls: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]],
        tallies: dict[str, PeerTally],
        eos_ids: Sequence[int] = (),
    ) -> None:
        """Send ``calls`` (each: ``(prompt ids, off's output ids)`` per request, sent together; the calls one
        after another) to every GGUF's server with ``batch`` slots; add to ``tallies`` (one per kind).
        ``eos_ids``: the model's end ids, left out of ``off``'s ids when comparing (llama.cpp's ``ignore_eos``
        bans them).  Raises ``OSError`` when a server fails."""
        ends = frozenset(eos_ids)
        for kind in self.ggufs:
            tally = tallies[kind]
            for call in calls:
                sent = [(list(p), list(out)) for p, out in call if out]
                if not sent:
                    continue
                need = max(len(p) + len(out) for p, out in sent) + 8
                server = self.server(kind, batch, need)
                requests = [(p, len(out)) for p, out in sent]
                _, done, wall = llama_cpp.run_requests(server, requests, sequential=False, cache_prompt=True)
                tally.wall_s += wall
                for (_, out), completion in zip(sent, done):
                    tally.requests += 1
                    tally.output_tokens += len(completion.tokens)
                    ours = list(out)
                    while ours and ours[-1] in ends:
                        ours.pop()
                    tally.identical += completion.tokens[: len(ours)] == ours

    def version(self) -> str | None:
        """``llama-server --version`` of a running server (None before one started)."""
        return next(iter(self._servers.values())).version() if self._servers else None

    def close(self) -> None:
        """Stop every server."""
        while self._servers:
            _, server = self._servers.popitem()
            server.close()


def best(cell: dict[str, dict[str, Any]], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fastest GGUF of ``peers`` beside the fastest configuration of ``cell`` other than ``off`` (``off``
    when it is the only one) and beside ``off``: their tok/s and ratios (ours over llama.cpp's)."""
    kind = max(peers, key=lambda k: peers[k]["tok_s"])
    theirs = peers[kind]["tok_s"]
    speculating = [name for name in cell if name != "off"] or ["off"]
    name = max(speculating, key=lambda n: cell[n]["tok_s"])
    ours, off = cell[name]["tok_s"], cell["off"]["tok_s"]
    return {
        "llama_cpp": kind,
        "llama_cpp_tok_s": theirs,
        "config": name,
        "config_tok_s": ours,
        "ratio": round(ours / theirs, 3) if theirs else None,
        "off_ratio": round(off / theirs, 3) if theirs else None,
    }


def lines(peers: dict[str, dict[str, Any]], top: dict[str, Any]) -> str:
    """The cell's llama.cpp rows under the bench's table."""
    row = "   ".join(
        f"{kind} {r['tok_s']:.1f} tok/s (same ids {r['identical']}/{r['requests']})" for kind, r in peers.items()
    )
    ratio = "-" if top["ratio"] is None else f"{top['ratio']:.2f}x"
    off = "-" if top["off_ratio"] is None else f"{top['off_ratio']:.2f}x"
    return (
        f"llama.cpp      {row}\n"
        f"vs llama.cpp   best {top['config']} {top['config_tok_s']:.1f} tok/s = {ratio} llama.cpp {top['llama_cpp']} "
        f"{top['llama_cpp_tok_s']:.1f} tok/s (off: {off})"
    )


__all__ = ["DEFAULT_MODES", "LlamaCppBeside", "PeerTally", "best", "lines"]
