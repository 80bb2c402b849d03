"""The routing workloads of ``mechserve bench fleet``: seeded, generated here, fed to the fleet as they arrive.

Every workload is a stream of arrivals in fleet steps.  Open-loop ones (``tenants``, ``rag``,
``uniform``) draw Poisson arrivals at ``rate`` requests per step; ``multiturn`` is closed-loop: a
conversation's next turn arrives a think time after its previous turn finished, and carries the
whole conversation so far (system prompt, every earlier message and answer) as its prefix, so only
a replica that served the earlier turns (or holds their blocks) can reuse it.

* ``tenants``: ``tenants`` tenants, each with its own system prompt; each request is one tenant's
  (Zipf-popular, exponent ``zipf``) system prompt plus a user message.
* ``multiturn``: conversations of ``turns`` turns, each opened on one tenant's system prompt.
* ``rag``: a pool of ``documents`` shared documents; each request is a fixed instruction, ``k``
  documents (Zipf-popular, the most relevant first) and a question.
* ``uniform``: the control: every prompt is its own random ids, so no policy can reuse anything.

Token ids are random 16-bit ids (never 0, the scripted model's EOS id).  Standard library only.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

WORKLOADS = ("tenants", "multiturn", "rag", "uniform")


@dataclass(frozen=True)
class Arrival:
    """One request: its id, the fleet step it arrives at, its prompt and how many tokens it asks for."""

    request_id: str
    step: int
    tokens: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class Sizes:
    """The knobs of the workloads (token counts are tokens, times are fleet steps)."""

    requests: int = 10_000
    rate: float = 8.0  # requests per step (open-loop workloads; conversation starts scale to it)
    tenants: int = 256
    system: tuple[int, int] = (256, 1024)
    message: tuple[int, int] = (32, 256)
    output: tuple[int, int] = (16, 64)
    zipf: float = 1.0
    turns: tuple[int, int] = (2, 8)
    think: tuple[int, int] = (10, 60)
    documents: int = 2000
    document: tuple[int, int] = (256, 512)
    k: int = 3
    question: tuple[int, int] = (16, 64)
    instruction: int = 64
    uniform: tuple[int, int] = (64, 1024)


def random_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` random ids in 1 .. 65535 (fast: one ``randbytes`` call)."""
    ids = array("H", rng.randbytes(2 * n))
    return [t or 1 for t in ids]


class Zipf:
    """Draws from ``0 .. n - 1`` with weight ``1 / (i + 1) ** s`` (rank 0 the most popular)."""

    def __init__(self, n: int, s: float) -> None:
        weights = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))
        self.cumulative, self.total = weights, weights[-1]

    def draw(self, rng: random.Random) -> int:
        return bisect.bisect_left(self.cumulative, rng.random() * self.total)


@dataclass
class Workload:
    """A stream of arrivals: ``due(step)`` gives the requests arriving at ``step`` (call it for every
    step in order); ``finished(request_id, step, output_ids)`` tells a closed-loop workload a request
    ended; ``exhausted`` is true once no request will ever arrive again."""

    name: str
    sizes: Sizes
    seed: int = 0
    issued: int = 0
    _heap: list[tuple[int, int, Arrival]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def due(self, step: int) -> list[Arrival]:
        out = []
        while self._heap and self._heap[0][0] <= step:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def finished(self, request_id: str, step: int, output_ids: Sequence[int]) -> None:
        """An open-loop workload ignores it."""

    @property
    def exhausted(self) -> bool:
        return not self._heap

    def _push(self, arrival: Arrival) -> None:
        heapq.heappush(self._heap, (arrival.step, next(self._order), arrival))
        self.issued += 1


def _poisson_steps(rng: random.Random, rate: float, n: int) -> list[int]:
    """Arrival steps of ``n`` requests arriving as a Poisson process of ``rate`` per step."""
    t, steps = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        steps.append(int(t))
    return steps


def _uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def tenants(sizes: Sizes, seed: int = 0) -> Workload:
    """Many tenants, each with its own system prompt (see the module docstring)."""
    rng = random.Random(f"tenants/{seed}")
    systems = [random_ids(rng, _uniform(rng, sizes.system)) for _ in range(sizes.tenants)]
    pick = Zipf(sizes.tenants, sizes.zipf)
    w = Workload("tenants", sizes, seed)
    for i, step in enumerate(_poisson_steps(rng, sizes.rate, sizes.requests)):
        prompt = systems[pick.draw(rng)] + random_ids(rng, _uniform(rng, sizes.message))
        w._push(Arrival(f"t{i}", step, prompt, _uniform(rng, sizes.output)))
    return w


def rag(sizes: Sizes, seed: int = 0) -> Workload:
    """Shared documents, a few per request (see the module docstring)."""
    rng = random.Random(f"rag/{seed}")
    instruction = random_ids(rng, sizes.instruction)
    docs = [random_ids(rng, _uniform(rng, sizes.document)) for _ in range(sizes.documents)]
    pick = Zipf(sizes.documents, sizes.zipf)
    w = Workload("rag", sizes, seed)
    for i, step in enumerate(_poisson_steps(rng, sizes.rate, sizes.requests)):
        chosen: list[int] = []
        while len(chosen) < min(sizes.k, sizes.documents):
            d = pick.draw(rng)
            if d not in chosen:
                chosen.append(d)
        prompt = instruction + [t for d in chosen for t in docs[d]] + random_ids(rng, _uniform(rng, sizes.question))
        w._push(Arrival(f"g{i}", step, prompt, _uniform(rng, sizes.output)))
    return w


def uniform(sizes: Sizes, seed: int = 0) -> Workload:
    """The control: unrelated random prompts."""
    rng = random.Random(f"uniform/{seed}")
    w = Workload("uniform", sizes, seed)
    for i, step in enumerate(_poisson_steps(rng, sizes.rate, sizes.requests)):
        w._push(Arrival(f"u{i}", step, random_ids(rng, _uniform(rng, sizes.uniform)), _uniform(rng, sizes.output)))
    return w


@dataclass
class _Conversation:
    turns_left: int
    prompt: list[int]


class MultiTurn(Workload):
    """Closed-loop conversations (see the module docstring): turn k + 1 arrives ``think`` steps after
    turn k finished, its prompt turn k's prompt + turn k's output ids + a new user message."""

    def __init__(self, sizes: Sizes, seed: int = 0) -> None:
        super().__init__("multiturn", sizes, seed)
        self.rng = rng = random.Random(f"multiturn/{seed}")
        self.systems = [random_ids(rng, _uniform(rng, sizes.system)) for _ in range(sizes.tenants)]
        pick = Zipf(sizes.tenants, sizes.zipf)
        mean_turns = (sizes.turns[0] + sizes.turns[1]) / 2
        self.open: dict[str, _Conversation] = {}
        planned, c = 0, 0
        starts = []
        while planned < sizes.requests:
            turns = min(_uniform(rng, sizes.turns), sizes.requests - planned)
            starts.append((c, turns, pick.draw(rng)))
            planned += turns
            c += 1
        for (c, turns, tenant), step in zip(starts, _poisson_steps(rng, sizes.rate / mean_turns, len(starts))):
            self._turn(f"c{c}", _Conversation(turns, list(self.systems[tenant])), step)

    def _turn(self, conversation: str, conv: _Conversation, step: int) -> None:
        rng = self.rng
        conv.prompt = conv.prompt + random_ids(rng, _uniform(rng, self.sizes.message))
        conv.turns_left -= 1
        request_id = f"{conversation}.{self.issued}"
        self.open[request_id] = conv
        self._push(Arrival(request_id, step, conv.prompt, _uniform(rng, self.sizes.output)))

    def finished(self, request_id: str, step: int, output_ids: Sequence[int]) -> None:
        conv = self.open.pop(request_id, None)
        if conv is None or conv.turns_left <= 0:
            return
        conv.prompt = conv.prompt + list(output_ids)
        self._turn(request_id.split(".")[0], conv, step + 1 + _uniform(self.rng, self.sizes.think))

    @property
    def exhausted(self) -> bool:
        return not self._heap and not self.open


def make(name: str, sizes: Sizes, seed: int = 0) -> Workload:
    """The workload ``name`` (one of ``WORKLOADS``).  Raises ``ValueError`` for another name."""
    makers = {"tenants": tenants, "multiturn": MultiTurn, "rag": rag, "uniform": uniform}
    if name not in makers:
        raise ValueError(f"unknown fleet workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return makers[name](sizes, seed)
