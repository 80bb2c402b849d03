"""The harness's workloads: seeded lists of token-id prompts with fixed output lengths (standard library only).

Every request ignores EOS, so it produces exactly ``max_tokens`` wanted tokens on every engine.
Prompt ids are drawn from ``[low_id, vocab_size)`` (ordinary tokens: SmolLM2's specials are the
first ids).

* ``throughput``: ``num`` requests submitted at once; prompt lengths uniform in ``prompt_range``,
  output lengths uniform in ``output_range`` (both inclusive).  The issue's mixed workload is 32
  requests, prompts 64-512, outputs 32-256.
* ``latency``: ``num`` requests run one after another (batch 1), prompt ``prompt_len``, output
  ``output_len``.
* ``prefix``: ``num`` requests sharing one ``system_len``-token system prompt, each followed by its
  own ``suffix_len`` tokens, all submitted at once.
* ``spec``: copy-heavy prompts for speculative decoding: a random passage repeated ``repeats`` times,
  so that the continuation tends to copy it (prompt lookup finds its guesses in the prompt).
* ``serve``: Poisson arrivals (``rate`` requests/s) of ``num`` requests against ``mechserve serve``.
* ``multiturn``: ``num`` conversations of ``turns`` turns, interleaved: each turn's prompt is the
  previous prompt, the previous answer and a new user message through the model's chat template,
  submitted as soon as the previous answer is done (``make_conversations``; the messages are text,
  so the answers end at EOS or at ``output_len`` tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("throughput", "latency", "prefix", "spec", "serve", "multiturn")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: prompt ids and the exact number of output tokens wanted."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """A named list of requests; ``sequential`` runs them one at a time (batch 1).  ``params`` records
    the sizes it was generated from (for the results file)."""

    name: str
    requests: tuple[BenchRequest, ...]
    sequential: bool = False
    params: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


# Full sizes (the targets) and --quick sizes (about a minute for everything on 2 CPU cores).
SIZES: dict[str, dict[str, dict[str, object]]] = {
    "throughput": {
        "full": {"num": 32, "prompt_range": (64, 512), "output_range": (32, 256)},
        "quick": {"num": 8, "prompt_range": (16, 64), "output_range": (8, 24)},
    },
    "latency": {
        "full": {"num": 3, "prompt_len": 512, "output_len": 64},
        "quick": {"num": 2, "prompt_len": 64, "output_len": 16},
    },
    "prefix": {
        "full": {"num": 32, "system_len": 1024, "suffix_len": 32, "output_len": 32},
        "quick": {"num": 8, "system_len": 128, "suffix_len": 8, "output_len": 8},
    },
    "spec": {
        "full": {"num": 8, "passage_len": 64, "repeats": 4, "output_len": 128},
        "quick": {"num": 4, "passage_len": 16, "repeats": 3, "output_len": 16},
    },
    "serve": {
        "full": {"num": 32, "prompt_len": 128, "output_len": 64, "rate": 2.0},
        "quick": {"num": 6, "prompt_len": 16, "output_len": 8, "rate": 8.0},
    },
    "multiturn": {
        "full": {"num": 4, "turns": 4, "output_len": 160},
        "quick": {"num": 2, "turns": 3, "output_len": 12},
    },
}

# The conversations' topics and follow-up questions: plain requests a chat model answers at length.
TOPICS = (
    "the ocean tides",
    "volcanoes",
    "baking bread",
    "the moon",
    "chess openings",
    "bicycles",
    "rainbows",
    "honey bees",
    "public libraries",
    "steam trains",
    "coral reefs",
    "the printing press",
    "glaciers",
    "the human heart",
    "paper money",
    "lighthouses",
)
FOLLOW_UPS = (
    "Why does that happen?",
    "Can you give me a concrete example?",
    "What is the most surprising part of that?",
    "How would you explain it to a ten-year-old?",
    "What do people often get wrong about it?",
    "Say more about the first point you made.",
    "How has this changed over the last hundred years?",
    "Summarize what you told me so far in two sentences.",
)


@dataclass(frozen=True, slots=True)
class Conversations:
    """``messages[c]``: conversation ``c``'s user messages, one per turn (text); each answer has at most
    ``max_tokens`` tokens.  ``params`` records the sizes (for the results file)."""

    name: str
    messages: tuple[tuple[str, ...], ...]
    max_tokens: int
    params: dict[str, object] = field(default_factory=dict)


def make_conversations(*, quick: bool = False, seed: int = 0, **overrides: object) -> Conversations:
    """The ``multiturn`` workload: ``num`` conversations of ``turns`` user messages (a topic, then seeded
    follow-up questions), answers of up to ``output_len`` tokens.  Raises ``ValueError`` for an unknown size."""
    sizes = dict(SIZES["multiturn"]["quick" if quick else "full"])
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise ValueError(f"workload 'multiturn' has no size(s) {', '.join(sorted(unknown))}")
    sizes.update(overrides)
    num, turns = int(sizes["num"]), int(sizes["turns"])  # type: ignore[call-overload]
    if num > len(TOPICS):
        raise ValueError(f"workload 'multiturn' has {len(TOPICS)} topics: num must be at most {len(TOPICS)}")
    rng = random.Random(seed)
    messages = []
    for topic in rng.sample(TOPICS, k=num):
        follow = [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        messages.append((f"Tell me about {topic}.", *follow))
    return Conversations("multiturn", tuple(messages), int(sizes["output_len"]), {**sizes, "seed": seed})  # type: ignore[call-overload]


def make_workload(
    name: str, vocab_size: int, *, quick: bool = False, seed: int = 0, low_id: int = 100, **overrides: object
) -> Workload:
    """Generate workload ``name`` (one of ``WORKLOADS``) at full or ``quick`` size; ``overrides`` replace sizes.

    Raises ``ValueError`` for an unknown workload or size name, or a vocabulary with no ordinary ids.
    """
    if name not in SIZES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if name == "multiturn":
        raise ValueError("the multiturn workload is text conversations: use make_conversations")
    sizes = dict(SIZES[name]["quick" if quick else "full"])
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise ValueError(f"workload {name!r} has no size(s) {', '.join(sorted(unknown))}")
    sizes.update(overrides)
    low = min(low_id, vocab_size // 2)
    if vocab_size - low < 2:
        raise ValueError(f"vocabulary of {vocab_size} ids is too small for a benchmark")
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(low, vocab_size) for _ in range(n))

    s: dict[str, object] = sizes
    reqs: list[BenchRequest] = []
    if name == "throughput":
        prompt_range: Any = s["prompt_range"]
        output_range: Any = s["output_range"]
        (plo, phi), (olo, ohi) = prompt_range, output_range
        for _ in range(int(s["num"])):  # type: ignore[call-overload]
            reqs.append(BenchRequest(ids(rng.randint(plo, phi)), rng.randint(olo, ohi)))
    elif name in ("latency", "serve"):
        for _ in range(int(s["num"])):  # type: ignore[call-overload]
            reqs.append(BenchRequest(ids(int(s["prompt_len"])), int(s["output_len"])))  # type: ignore[call-overload]
    elif name == "prefix":
        system = ids(int(s["system_len"]))  # type: ignore[call-overload]
        for _ in range(int(s["num"])):  # type: ignore[call-overload]
            reqs.append(BenchRequest(system + ids(int(s["suffix_len"])), int(s["output_len"])))  # type: ignore[call-overload]
    else:  # spec
        for _ in range(int(s["num"])):  # type: ignore[call-overload]
            passage = ids(int(s["passage_len"]))  # type: ignore[call-overload]
            reqs.append(BenchRequest(passage * int(s["repeats"]), int(s["output_len"])))  # type: ignore[call-overload]
    return Workload(name, tuple(reqs), sequential=name == "latency", params={**sizes, "seed": seed})
